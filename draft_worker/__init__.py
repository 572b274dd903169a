"""specd.draft_worker: the block-diffusion drafter side (DFlash, DSpark, DFlash 2).

Modules (docs/drafters.md is the contract):

* ``contract``   — draft GGUF arch / key / tensor names, expected tensors per hyper-parameters, errors;
* ``hparams``    — :class:`DrafterHParams` (typed, frozen), its validation and GGUF key I/O;
* ``hf_config``  — HF ``config.json`` + tensor shapes → hyper-parameters (nested-then-top-level keys);
* ``safetensors_io`` — numpy-only safetensors reading (single file, shards, BF16);
* ``convert``    — ``specd convert-drafter`` (HF → GGUF; mainline ``dflash`` GGUF → GGUF via ``dialect``);
* ``dialect``    — explicit translator for the mainline llama.cpp ``dflash`` dialect (C15);
* ``quantize``   — ``specd quantize-drafter`` (Q8_0 with per-tensor error report);
* ``gguf_loader``— load a draft GGUF as zero-copy ``specd.native.Tensor`` views; ``check_pair``;
* ``gguf_meta``  — typed GGUF metadata access, atomic GGUF writing;
* ``model``      — the drafter forward on specd.native: :class:`DrafterModel` (bound to the target's
  embedding / lm_head), :class:`DraftSequence` (``ingest`` context features, ``propose`` a block).
"""
