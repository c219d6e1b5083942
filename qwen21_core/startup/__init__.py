"""What happens at start-up, in order: the one home of the work that makes a fresh process's first image sooner.

1. Importing the pack starts nothing: no thread, no CUDA context.
2. A model starts loading on a CUDA device (pipeline.py `from_pretrained`): `priming.prime` loads PyTorch's and
   Triton's own kernels, the ones a first prompt launches, in background threads while the files are read.
3. The model is loaded: `model_warmup.start` compiles (or loads from disk) our Triton kernels for its shapes on a
   thread pool (`warmup.KernelWarmup`), in parts; each model's jobs are built beside the model (quant/, text/, dit/,
   vae/ kernel_warmup.py).
4. A run meets the warm-up (model_warmup.py): an encode pauses its jobs, the sampler waits for the DiT's first part,
   a launch of a later M bucket waits for that bucket's part, a VAE call runs torch's ops until its kernels are ready.

Two verbs: "prime" loads PyTorch's and Triton's own code (2); "warm up" compiles our kernels (3). QWEN21_KERNEL_WARMUP=0
turns both off. streams.py holds the one side stream per device and purpose that all of it (and the runs before a
CUDA-graph capture) uses.

The submodules are imported by name (`from .startup import model_warmup`): this file imports none of them, so the
model code they import may itself import streams.py or warmup.py without a circle.
"""
