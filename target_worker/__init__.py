"""specd.target_worker: the Qwen3.5 (GGUF arch ``qwen35``) target side of specd.

* :mod:`.gguf_loader` — open a qwen35 GGUF: typed hyperparameters (``Qwen35HParams``), validation,
  zero-copy ``specd.native.Tensor`` weight views (``Qwen35Weights``), tokenizer metadata.
* :mod:`.convert` — ``specd convert-target``: transformers checkpoint → GGUF (llama.cpp
  conventions), and the inverse mapping GGUF → transformers state dict for golden references.
* :mod:`.model` — the forward on specd.native: chunked prefill, decode, chain and tree verify,
  feature capture, exact deferred commit (``Qwen35Model``, ``SequenceState``).
* :mod:`.features` — the feature ring of drafter features keyed by absolute position.
* :mod:`.tokenizer` — the tokenizer rebuilt from GGUF metadata with the ``tokenizers`` library.
* :mod:`.perplexity` — ``specd perplexity``, llama.cpp's method.

Contract: docs/qwen35-target.md.
"""
