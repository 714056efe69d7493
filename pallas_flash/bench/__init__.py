"""Speed, accuracy and memory benchmark of ``pallas_flash``: ``python -m pallas_flash.bench``.

Everything is measured in one process on one device (``jax.devices()[0]``), our kernels beside
the baselines, except the memory sweep and the cold start, which give every point a fresh child
process.

- :mod:`~pallas_flash.bench.cases`: the shapes, variants, inputs and the FLOP formula;
- :mod:`~pallas_flash.bench.impls`: the implementations compared (ours, cuDNN, XLA, ...);
- :mod:`~pallas_flash.bench.timing`: the timer and one case over every implementation;
- :mod:`~pallas_flash.bench.accuracy`: the forward's error against a float32 reference;
- :mod:`~pallas_flash.bench.memory`: the peak-memory sweep;
- :mod:`~pallas_flash.bench.cold_start`: process start to the third training step, run by
  :mod:`~pallas_flash.bench.cold_start_child` in fresh processes;
- :mod:`~pallas_flash.bench.decode`: ``decode_attention`` against the copy bandwidth
  (``--decode``);
- :mod:`~pallas_flash.bench.train_step`: a Llama-style training step
  (:mod:`~pallas_flash.bench.llama`) with the attention swapped
  (``python -m pallas_flash.bench.train_step``);
- :mod:`~pallas_flash.bench.report`: results files, tables and the Markdown report (``--report``);
- :mod:`~pallas_flash.bench.plots`: the PNG plots.
"""
