r"""The guards: one module per outside system that can break the Stiefel constraint without a word.

Each module opens with what goes wrong silently without it, how it is detected, and what the user is shown; the
index, with the tests of each, is ``docs/guarantees.md``. They share one check, the frame check of
:mod:`geoopt_stiefel_attention._guard` (:math:`\max|W^\top W - I|` against a tolerance per dtype).

- :mod:`.optimizers`: optimizers that do not know the constraint, and optimizers built before the conversion;
- :mod:`.averaging`: averaged models (``AveragedModel``, model-EMA classes);
- :mod:`.ddp`: ``DistributedDataParallel``;
- :mod:`.fsdp`: FSDP1 and FSDP2;
- :mod:`.deepspeed`: DeepSpeed's ZeRO stages and fp16/bf16 modes;
- :mod:`.adapters`: PEFT's LoRA and other adapter layers;
- :mod:`.parametrize`: ``torch.nn.utils.parametrize.cached()``;
- :mod:`.casts`: dtype casts and ``to_empty()`` of the modules that hold frames;
- :mod:`.activation_checkpointing`: checkpointing without reentry and other saved-tensor hooks.

No guard walks the Python stack. Every private attribute of torch a guard reads is pinned by
``tests/test_integrations_pins.py``, which fails in one sentence naming the guard when a torch release changes it.
Nothing is imported here: each guard is imported by the part of the library that calls it.
"""
