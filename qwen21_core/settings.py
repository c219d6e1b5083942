"""The pack's `QWEN21_*` switches for the layers above kernels/: kernels/settings.py, re-exported (it lives there
because kernels read switches too and import nothing above them; its docstring says how and when they are read)."""

from ..kernels.settings import (  # noqa: F401 - re-exported
    AUTOTUNE,
    CONTROL_STREAM,
    FAST_LAUNCH,
    GGUF_PREFETCH,
    KERNEL_WARMUP,
    KERNEL_WARMUP_THREADS,
    MODELS,
    PARALLEL_LOAD_TIMEOUT,
    PARALLEL_TIMEOUT,
    QUANT_GEMM,
    QUANT_GEMM_CHOICES,
    VARIABLES,
    Settings,
    current,
    read,
    replace,
    reset,
    use,
)
