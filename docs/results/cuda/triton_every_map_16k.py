# The H100 run of docs/cuda.md "Every map on an H100": PYTHONPATH=. OUT=<dir> python3 this file (tile sizes forced;
# the rotary-position exactness rows first). Raw rows land in /tmp/o.json, copied to triton_every_map_16k.json.
import torch, json
from tools import triton_bench as tb
from linear_mha.functional import triton_kernel as tk
dev = torch.device('cuda'); timed = tb.timer(dev); bw = tb.copy_bandwidth(dev, timed); print('bw', bw / 1e9, flush=True)
tk.BLOCK = 32
for m in (False, True):
    print('rope32', m, tb.exactness(dev, torch.bfloat16, 'taylor_rope', m), flush=True)
tk.BLOCK = None
rows = []
for name in ['elu', 'taylor', 'focused', 'hedgehog', 'taylor_rope']:
    for r in tb.timings(dev, torch.bfloat16, 8, 16, 16384, 64, [64, 32] if name != 'taylor_rope' else [32], 5, timed, name, with_sdpa=name == 'elu'):
        r['method'] = name; rows.append(r); print(name, r, flush=True)
json.dump(dict(bw=bw, rows=rows), open('/tmp/o.json', 'w'))
