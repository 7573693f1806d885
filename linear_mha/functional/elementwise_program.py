"""A user's elementwise feature map, read off the callable as a short program of unary steps, so that the compiled
CPU kernels compute it inside their row loaders (forward and backward) instead of PyTorch making N-sized feature
tensors first (which took 1.7-2.6x the elu kernel's time; docs/benchmarks.md).

    kernel(q, k, v, lambda x: torch.relu(x) ** 2)      # read as [relu, pow 2]: runs inside the kernels

``program_map(fn)`` traces fn with torch.fx. When the trace is one chain from the input to the output of steps the
kernels know (below), each with constants only, and the program then reproduces fn on a float64 probe, it returns
a ``ProgramMap``, which calls fn as before wherever the features are made by PyTorch ops and gives the kernels its
program. Anything else (a learnable module, a row reduction, a branch on the data) keeps fn as it is, and
``why_not_program(fn)`` says why. Steps: relu, elu (alpha 1), exp, abs, x ** c (c > 0; a whole c up to 8), x + c,
x - c, c - x, x * c, x / c, -x, softplus (beta 1), sigmoid; at most MAX_STEPS of them. A kept program that reads a
user's module or calls a helper function is checked against its callable again on every call, on the same probe.
"""
import functools
import math
import operator
import types
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import compiling, functorch_active

MAX_STEPS = 8  # csrc/program.h's PROGRAM_STEPS
RELU, ELU, EXP, ABS, POW, ADD, MUL, SOFTPLUS, SIGMOID, POW_WHOLE = range(10)  # csrc/program.h's step codes
Step = Tuple[int, float]

# The steps' float64 meaning, what the probe checks a program against.
_MEANING = {RELU: lambda x, c: torch.relu(x), ELU: lambda x, c: F.elu(x), EXP: lambda x, c: torch.exp(x),
            ABS: lambda x, c: torch.abs(x), POW: lambda x, c: torch.pow(x, c), POW_WHOLE: lambda x, c: torch.pow(x, c),
            ADD: lambda x, c: x + c,
            MUL: lambda x, c: x * c, SOFTPLUS: lambda x, c: F.softplus(x), SIGMOID: lambda x, c: torch.sigmoid(x)}

_UNARY = {torch.relu: RELU, F.relu: RELU, "relu": RELU, torch.exp: EXP, "exp": EXP, torch.abs: ABS, "abs": ABS,
          operator.abs: ABS, torch.sigmoid: SIGMOID, "sigmoid": SIGMOID, F.softplus: SOFTPLUS, F.elu: ELU,
          torch.square: POW, "square": POW, torch.neg: MUL, operator.neg: MUL, "neg": MUL}
_BINARY = {operator.add: "add", torch.add: "add", "add": "add", operator.sub: "sub", torch.sub: "sub", "sub": "sub",
           operator.mul: "mul", torch.mul: "mul", "mul": "mul", operator.truediv: "div", torch.div: "div",
           "div": "div", operator.pow: "pow", torch.pow: "pow", "pow": "pow"}
# The arguments a step may carry after the value, in order, with the values the kernels' step computes (None: any).
_ALLOWED_ARGS = {F.relu: {"inplace": None}, F.elu: {"alpha": 1.0, "inplace": None},
                 F.softplus: {"beta": 1.0, "threshold": 20.0}}


def _step(node) -> Tuple[Optional[object], List[Step], Optional[str]]:
    """(the node's tensor input, its steps, why not) for one node of the trace."""
    target = node.target
    if target not in _UNARY and target not in _BINARY:
        return None, [], f"{getattr(target, '__name__', target)!s}, which is not a step the kernels know"
    args, kwargs = list(node.args), dict(node.kwargs)
    if target in _UNARY:
        allowed = _ALLOWED_ARGS.get(target, {})
        if len(args) > 1 + len(allowed):
            return None, [], f"{getattr(target, '__name__', target)} with arguments {args[1:]}"
        given = {**dict(zip(allowed, args[1:])), **kwargs}
        for key, value in given.items():
            if key not in allowed or (allowed[key] is not None and value != allowed[key]):
                return None, [], f"{getattr(target, '__name__', target)} with {key}={value!r}"
        return args[0], _unary_steps(target), None
    if kwargs:
        return None, [], f"{getattr(target, '__name__', target)} with {kwargs}"
    if len(args) == 2:
        kind = _BINARY[target]
        first, second = args
        first_is_node, second_is_node = _is_node(first), _is_node(second)
        if first_is_node == second_is_node or not isinstance(second if first_is_node else first, (int, float)) \
                or isinstance(second if first_is_node else first, bool):
            return None, [], f"{kind} of {first!r} and {second!r}: a step takes the value and one number"
        c = float(second if first_is_node else first)
        x = first if first_is_node else second
        if kind == "add":
            return x, [(ADD, c)], None
        if kind == "mul":
            return x, [(MUL, c)], None
        if kind == "sub":
            return x, ([(ADD, -c)] if first_is_node else [(MUL, -1.0), (ADD, c)]), None
        if kind == "div" and first_is_node and c != 0.0:
            return x, [(MUL, 1.0 / c)], None
        if kind == "pow" and first_is_node and c > 0.0 and math.isfinite(c):
            if c.is_integer():  # decided on the float64 value: x ** 2.00000001 is NaN below 0, x ** 2 is not
                return (x, [(POW_WHOLE, c)], None) if c <= 8 else (None, [], f"pow {c:g}: whole powers go to 8")
            return x, [(POW, c)], None
        return None, [], f"{kind} with {'the value as the exponent' if not first_is_node else c}"
    return None, [], f"{getattr(target, '__name__', target)!s} with arguments {args}"


def _unary_steps(target) -> List[Step]:
    """The steps of a one-argument function or method the kernels know: square is x ** 2, negation x * -1."""
    if target in (torch.square, "square"):
        return [(POW_WHOLE, 2.0)]
    code = _UNARY[target]
    return [(MUL, -1.0)] if code == MUL else [(code, 0.0)]


def _hashable(value) -> bool:
    try:
        hash(value)
        return True
    except TypeError:
        return False


def _is_node(value) -> bool:
    return isinstance(value, torch.fx.Node)


def read_program(fn: Callable[[Tensor], Tensor]) -> Tuple[Optional[List[Step]], Optional[str]]:
    """(fn's steps, None) when fn is a chain of known steps that reproduces it, else (None, why not)."""
    if _hashable(fn) and fn in _UNARY and not isinstance(fn, str):  # torch.relu or F.softplus itself: nothing to trace
        steps = _unary_steps(fn)
        return (steps, None) if _reproduces(fn, steps) else (None, "its program does not reproduce it on a probe")
    try:
        graph = torch.fx.symbolic_trace(fn).graph
    except Exception as exc:  # anything torch.fx cannot trace stays a PyTorch map
        return None, f"torch.fx cannot trace it ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
    nodes = list(graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        return None, f"it takes {len(inputs)} inputs, not one tensor"
    steps, current = [], inputs[0]
    for node in nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            if node.args[0] is not current:
                return None, "its output is not the end of one chain of steps from the input"
            break
        if node.op not in ("call_function", "call_method"):
            return None, f"it uses {node.op} {node.target!s} (a module or an attribute)"
        source, new, why = _step(node)
        if why is not None:
            return None, why
        if source is not current:
            return None, "it is not one chain of steps from the input (a value used twice, or two branches)"
        steps += new
        current = node
    if len(steps) > MAX_STEPS:
        return None, f"{len(steps)} steps, more than the kernels take ({MAX_STEPS})"
    return (steps, None) if _reproduces(fn, steps) else (None, "its program does not reproduce it on a probe")


def _make_probe() -> Tensor:
    with torch.inference_mode(False):  # made at import, maybe inside inference mode, used anywhere after
        g = torch.Generator().manual_seed(0)
        return torch.cat([torch.linspace(-6, 6, 121, dtype=torch.float64),
                          torch.randn(71, dtype=torch.float64, generator=g)]).reshape(2, 2, 3, 16)


_PROBE = _make_probe()  # made once: a program is checked against its callable on many calls (program_map)


def _reproduces(fn, steps: List[Step]) -> bool:
    """Whether the steps give fn's values (shape included) on a float64 probe of values from -6 to 6."""
    probe = _PROBE
    try:
        with torch.no_grad():
            expected = fn(probe.clone())
    except Exception:
        return False
    got = probe
    for code, c in steps:
        got = _MEANING[code](got, c)
    return isinstance(expected, Tensor) and expected.shape == probe.shape and \
        torch.allclose(got, expected.to(torch.float64), rtol=1e-9, atol=1e-12, equal_nan=True)


class ProgramMap:
    """A user's elementwise map with its program: called, it is the user's callable; the compiled kernels read its
    steps instead (``compiled_map`` names the map to them, ``compiled_settings`` gives the steps' layout)."""

    compiled_map = "program"

    def __init__(self, fn: Callable[[Tensor], Tensor], steps: List[Step]):
        self.fn, self.steps = fn, steps
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self._layout = _layout(tuple(steps))

    def __call__(self, x: Tensor) -> Tensor:
        return self.fn(x)

    def __repr__(self):
        return f"ProgramMap({self.__name__}: {self.steps})"

    def why_not_compiled(self, q: Tensor) -> Optional[str]:
        return None

    def compiled_settings(self, q: Tensor) -> Tuple[float, Tensor]:
        """(power, data) as the entry points take them: no power; data the program [steps, op, c, op, c, ...]."""
        return 0.0, self._layout


@functools.lru_cache(maxsize=1024)
def _layout(steps: Tuple[Step, ...]) -> Tensor:
    """The steps as the kernels read them, [steps, op, c, op, c, ...] float32: one tensor per program, not per call
    (a method's map is a new ProgramMap on every call). Never written to, so safely shared."""
    with torch.inference_mode(False):  # made once, maybe in inference, then saved by a backward
        return torch.tensor([float(len(steps))] + [float(x) for step in steps for x in step], dtype=torch.float32)


_read = {}  # key (below) -> ProgramMap or the reason there is none: a lambda made anew per call is read once
_STABLE = (int, float, bool, str, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
_TRUSTED_MODULES = ("torch", "math", "operator")  # and their submodules: their attributes are taken as fixed


def _may_drift(fn) -> bool:
    """Whether a function's program can change while its key does not: it reads a module of the user's (whose
    attributes may change) or calls a helper function (whose own globals may)."""
    if not isinstance(fn, types.FunctionType):
        return False
    names = fn.__globals__
    values = [names[name] for name in fn.__code__.co_names if name in names]
    values += [cell.cell_contents for cell in fn.__closure__ or ()]
    return any(isinstance(value, types.FunctionType) or (isinstance(value, types.ModuleType) and
                                                          value.__name__.split(".")[0] not in _TRUSTED_MODULES)
               for value in values)


def _key(fn):
    """What fn's program depends on, or None when that cannot be told (then fn is read on every call): a function's
    code, defaults, and the globals and closure values it reads (numbers, functions, modules), which the trace
    read as they were and which may change; a builtin (torch.relu) itself."""
    if isinstance(fn, types.FunctionType):
        names = fn.__globals__
        read = tuple((name, names[name]) for name in fn.__code__.co_names if name in names)
        cells = tuple(cell.cell_contents for cell in fn.__closure__ or ())
        if not all(isinstance(value, _STABLE) for value in [v for _, v in read] + list(cells)):
            return None  # e.g. a config object whose attribute the trace read: it may change unseen
        key = (fn.__code__, fn.__defaults__, repr(fn.__kwdefaults__), read, cells)
    elif isinstance(fn, types.BuiltinFunctionType):
        key = fn
    else:
        return None
    return key if _hashable(key) else None


def _why_not_candidate(fn) -> Optional[str]:
    """Why fn is not even looked at as a program (a graph or transform is recording, or it is not a plain callable),
    or None."""
    if compiling() or functorch_active():
        return "inside torch.compile, torch.export, torch.jit.trace or a torch.func transform"
    if isinstance(fn, str) or not callable(fn) or hasattr(fn, "compiled_map") or isinstance(fn, torch.nn.Module):
        return "it is a named map, a map with settings of its own, or a module"
    return None


def why_not_program(fn) -> Optional[str]:
    """Why the callable fn cannot run inside the kernels as a program of steps, or None."""
    why = _why_not_candidate(fn)
    if why is not None:
        return why
    if isinstance(program_map(fn), ProgramMap):
        return None
    key = _key(fn)
    if key is None:
        return ("it is not a plain function or builtin whose program can be kept: a callable object, or a function "
                "reading an object (a closure or global) whose values a trace would read once")
    why = _read.get(key)
    return why if isinstance(why, str) else read_program(fn)[1]


def program_for(owner, fn):
    """fn, a map that ``owner`` (an attention method) makes anew on each call from settings fixed at its
    construction, as a ``ProgramMap`` when it is a chain of steps: read once per owner, so the closure's key
    (``_key``) is not needed. A map that reads the method's learnable state holds tensors, which no step takes."""
    if compiling() or functorch_active():
        return fn
    steps = owner.__dict__.get("_elementwise_program")
    if steps is None or (steps and not _reproduces(fn, steps)):  # read again when the map changed (its state)
        steps = owner.__dict__["_elementwise_program"] = read_program(fn)[0] or ()
    return ProgramMap(fn, steps) if steps else fn


def program_map(feature_map):
    """feature_map as a ``ProgramMap`` when it is a function the kernels can run as steps; otherwise unchanged (a
    named map, a map with its own settings, a module, a callable whose program cannot be read or kept). A function
    is read once per key (``_key``), so a lambda made anew on every call is traced only the first time."""
    if _why_not_candidate(feature_map) is not None:
        return feature_map
    key = _key(feature_map)
    if key is None:
        return feature_map
    found = _read.get(key)
    # A kept program that may drift (_may_drift) is checked against the callable again on every call (a float64
    # probe, tens of microseconds): what the trace read through a module's attribute or a helper's globals may
    # have changed since.
    if found is None or (isinstance(found, ProgramMap) and _may_drift(feature_map)
                         and not _reproduces(feature_map, found.steps)):
        steps, why = read_program(feature_map)
        found = ProgramMap(feature_map, steps) if steps is not None else why
        if len(_read) < 4096:
            _read[key] = found
    if isinstance(found, ProgramMap) and found.fn is not feature_map:
        found = ProgramMap(feature_map, found.steps)  # another function object with the same key
    return found if isinstance(found, ProgramMap) else feature_map
