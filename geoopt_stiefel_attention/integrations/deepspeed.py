r"""DeepSpeed around a frame optimizer (ZeRO stages 1-3, and its ``"fp16"``/``"bf16"`` modes at any stage).

**What goes wrong silently without it.** DeepSpeed replaces the tensors in the optimizer's ``param_groups``: ZeRO
stages 1-3 hand it flat fp32 partitions, and its ``"fp16"``/``"bf16"`` modes, at ZeRO stage 0 too, hand it fp32
copies (through ``FP16_Optimizer``, ``FP16_UnfusedOptimizer`` or ``BF16_Optimizer``). No tensor the optimizer then
sees is a frame, so it would update every one as AdamW and the orthonormality constraint would be lost.

**How it is detected.** A frame optimizer remembers the identity of every frame it was given (at construction and
by ``add_param_group``) and, at each step outside ``torch.compile``, checks that its ``param_groups`` still hold them
all; the record survives ``load_state_dict``, ``copy.deepcopy`` and pickling. Nothing private to DeepSpeed or torch
is read.

**What the user is shown.** A ``RuntimeError`` at the first step, before anything changes, counting the frames
that are gone and naming what works: ZeRO stage 0, DDP, or FSDP2 with
``geoopt_stiefel_attention.distributed.fully_shard_by_heads``, with fp32 parameters (under DeepSpeed leave out its
``"fp16"`` and ``"bf16"`` sections and compute in low precision with torch autocast).

**Where the code is.** In the frame optimizers' base, ``FrameOptimizer._record_frames`` and
``FrameOptimizer._check_frames_still_held`` (``geoopt_stiefel_attention/optim/_base.py``): the base is being
rebuilt (issue 58, item 3), so the check was not moved here in this round; the base can take it from this module.

Tests: ``tests/test_deepspeed.py`` (stage 0 trains on the manifold; stages 1-3 refused),
``tests/test_optim_table.py`` (``-k replaced``).
"""

from __future__ import annotations

__all__: list[str] = []
