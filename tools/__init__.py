"""Benchmarks, trainers and reports that use linear_mha (never imported by it). Run each from the repository root
as a module, e.g. ``python -m linear_mha.tools.benchmark --quick``; every one prints its defaults with ``--help``.

    benchmark        speed, memory and accuracy of every method against SDPA / nn.MultiheadAttention and peers
    benchmark_cases  the cases benchmark times: methods, FLOP formulas, inputs, float64 references
    measure          the one timing and memory module: interleaved timing, peak memory in a fresh process
    cpu_allocator    which malloc a process runs under, and glibc's keep-freed-memory setting
    ab_builds        another checkout's compiled CPU code against this one's, interleaved in one process
    detr_compare     DETR against Linear-DETRs on the synthetic set, over seeds; the encoder at growing sizes
    detr_variants    the variant names detr_compare takes, as trainer options; which are exact softmax
    detr_records     detr_compare's records files: summary, AP curves, files of one machine joined
    detr_diagnose    each method's attention on a trained DETR's encoder inputs, against its softmax
    patch_model      patch a torchvision / timm model and report the deviation and the speed
    train_lm         train a byte-level LM; lm_ablation compares its variants over seeds
    make_synthetic_coco  the synthetic COCO-format set on its own
"""
