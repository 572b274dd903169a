"""specd.target_worker: the Qwen3.5 (GGUF arch ``qwen35``) target side of specd.

* :mod:`.gguf_loader` — open a qwen35 GGUF: typed hyperparameters (``Qwen35HParams``), validation,
  zero-copy ``specd.native.Tensor`` weight views (``Qwen35Weights``), tokenizer metadata.
* :mod:`.convert` — ``specd convert-target``: transformers checkpoint → GGUF (llama.cpp
  conventions), and the inverse mapping GGUF → transformers state dict for golden references.

Contract: docs/qwen35-target.md.
"""
