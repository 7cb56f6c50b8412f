"""Every private attribute of torch that the library reads, pinned: when a torch release drops or renames one, its
test fails in one sentence naming the attribute, the file that reads it and what for (DESIGN.md, "The shape that
absorbs new guarantees": a private attribute of torch is read only behind such a test).

A pin is :class:`Pin`: the attribute, its reader, its purpose and where to find it (a module, a class, or an object
made on a one-rank gloo group: a ``DistributedDataParallel``, FSDP1's flat parameter, a ``DTensor``). A few
attributes are also pinned by what they mean (DDP's marker is set inside its forward, the saved-tensor hooks are
seen inside ``saved_tensors_hooks``, the parametrize cache flag inside ``cached()``). Companions: with the attribute
deleted (``monkeypatch.delattr``, or a stand-in object where torch's C types refuse deletion), each pin fails with
exactly its sentence; and the list of pins covers every ``_``-prefixed torch attribute named in the package's source
(a scan, with its own companion).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.optim.optimizer as torch_optimizer
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import parametrize

import geoopt_stiefel_attention

PACKAGE = Path(geoopt_stiefel_attention.__file__).parent

pytestmark = pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`:UserWarning")  # one rank


@dataclass(frozen=True)
class Pin:
    """One private attribute of torch the library reads: ``name`` on the object ``where(objects)`` returns."""

    what: str  # how the sentence names it
    name: str  # the attribute
    reader: str  # the file that reads it
    purpose: str  # what for
    where: Callable[[dict], object]  # the object that must have it, from the objects of the one-rank group

    def sentence(self) -> str:
        return (f"torch {torch.__version__} no longer has {self.what}, which {self.reader} reads to {self.purpose}; "
                f"update that guard.")

    def check(self, holder: object) -> None:
        assert hasattr(holder, self.name), self.sentence()


def _module(obj):
    return lambda objects: obj


PINS = [
    Pin("DistributedDataParallel._active_ddp_module", "_active_ddp_module", "integrations/ddp.py",
        "find the DDP whose forward is running", _module(DistributedDataParallel)),
    Pin("DistributedDataParallel(...)._module_parameters", "_module_parameters", "integrations/ddp.py",
        "list the parameters a DDP synchronises", lambda o: o["ddp"]),
    Pin("DistributedDataParallel(...)._delay_all_reduce_params", "_delay_all_reduce_params", "integrations/ddp.py",
        "list the parameters a DDP synchronises late", lambda o: o["ddp"]),
    Pin("the _ddp_ignored mark of DistributedDataParallel._set_params_and_buffers_to_ignore_for_model",
        "_ddp_ignored", "integrations/ddp.py", "leave out the frames a user told DDP to ignore",
        lambda o: o["ignored"]),
    Pin("the _fsdp_flattened mark of FSDP1's flat parameters", "_fsdp_flattened", "integrations/fsdp.py",
        "refuse frames FSDP1 flattened", lambda o: o["flat"]),
    Pin("the _fsdp_flattened mark of FSDP1's parameter views (use_orig_params=True)", "_fsdp_flattened",
        "integrations/fsdp.py", "refuse frames FSDP1 flattened", lambda o: o["view"]),
    Pin("FlatParameter._param_infos", "_param_infos", "integrations/fsdp.py",
        "find the frames inside an FSDP1 flat parameter", lambda o: o["flat"]),
    Pin("DTensor._local_tensor", "_local_tensor", "distributed.py (and the frame check, nn.py, convert/)",
        "update and check a sharded frame's local heads", lambda o: o["dtensor"]),
    Pin("torch._C._autograd._top_saved_tensors_default_hooks", "_top_saved_tensors_default_hooks",
        "integrations/activation_checkpointing.py", "build a weight at each read under activation checkpointing",
        lambda o: torch._C._autograd),
    Pin("torch.nn.utils.parametrize._cache_enabled", "_cache_enabled", "optim/_base.py (integrations/parametrize.py)",
        "warn of a step inside parametrize.cached()", _module(parametrize)),
    Pin("torch.nn.utils.parametrize._cache", "_cache", "optim/_base.py (integrations/parametrize.py)",
        "warn of a step inside parametrize.cached()", _module(parametrize)),
    Pin("Tensor._version", "_version", "integrations/averaging.py and integrations/optimizers.py",
        "see frames and state-dict entries changed in place", lambda o: o["tensor"]),
    Pin("torch._assert_async", "_assert_async", "_guard.py", "check frames inside a compiled or captured forward",
        _module(torch)),
    Pin("torch._C._functorch.is_functorch_wrapped_tensor", "is_functorch_wrapped_tensor", "_linalg.py",
        "skip host reads under functorch transforms", lambda o: torch._C._functorch),
    Pin("torch.optim.optimizer._get_capturable_supported_devices", "_get_capturable_supported_devices",
        "optim/_base.py", "choose torch's capturable AdamW for the Euclidean parameters", _module(torch_optimizer)),
    Pin("Optimizer._optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_pre_hooks", "optim/_base.py",
        "run load-state-dict pre hooks before its own checks", lambda o: o["optimizer"]),
    Pin("Optimizer._optimizer_load_state_dict_post_hooks", "_optimizer_load_state_dict_post_hooks", "optim/_base.py",
        "run load-state-dict post hooks after loading", lambda o: o["optimizer"]),
    Pin("torch._foreach_copy_", "_foreach_copy_", "optim/ (_batching.py, adam.py, muon.py)",
        "stage and write back stacked frames", _module(torch)),
    Pin("torch._foreach_add_", "_foreach_add_", "optim/ (_batching.py, adam.py, muon.py)",
        "advance the step counts of a batch", _module(torch)),
    Pin("torch._foreach_sub_", "_foreach_sub_", "optim/_base.py",
        "take back the step counts of non-frame parameters skipped for a non-finite gradient", _module(torch)),
    Pin("torch._foreach_norm", "_foreach_norm", "optim/_base.py",
        "find the non-frame parameters whose gradient is not finite, one fused norm per group", _module(torch)),
    Pin("Module._parameters", "_parameters", "integrations/casts.py, convert/",
        "read and rewrap the frames a module holds itself", lambda o: o["module"]),
    Pin("Module._buffers", "_buffers", "convert/checkpoints.py", "write state dicts in the stock order",
        lambda o: o["module"]),
    Pin("Module._modules", "_modules", "integrations/adapters.py, convert/",
        "find an adapter layer wrapping a converted projection", lambda o: o["module"]),
    Pin("Module._non_persistent_buffers_set", "_non_persistent_buffers_set", "convert/checkpoints.py",
        "write state dicts in the stock order", lambda o: o["module"]),
    Pin("Module._apply", "_apply", "integrations/casts.py", "re-project and rewrap frames after a cast",
        _module(torch.nn.Module)),
    Pin("Module._load_from_state_dict", "_load_from_state_dict", "nn.py",
        "keep frames on the manifold when a state dict is loaded", _module(torch.nn.Module)),
    Pin("the _metadata of Module.state_dict()", "_metadata", "convert/checkpoints.py",
        "drop the parametrized entries' metadata from a stock state dict", lambda o: o["state_dict"]),
    Pin("MultiheadAttention._qkv_same_embed_dim", "_qkv_same_embed_dim", "convert/layouts.py and nn.py",
        "tell a fused in_proj_weight from separate projections", lambda o: o["mha"]),
    Pin("torch._dynamo.list_backends", "list_backends", "bench/cli.py", "check a --compile-backend",
        lambda o: torch._dynamo),
    Pin("torch._dynamo.reset", "reset", "bench/paths.py", "drop the last frame set's compiled graphs",
        lambda o: torch._dynamo),
]

#: ``_``-prefixed names the package reads on objects other than ``self`` that are not torch's: its own methods and
#: attributes (of its modules, optimizers, argparse namespaces), and argparse's ``_actions``.
NOT_TORCH = {"_config", "_configure", "_export", "_install", "_run", "_stack_numel", "_workspaces", "_given",
             "_parser", "_actions", "_count_skipped", "_euclidean_by_design"}
#: torch's private submodules on the way to a pinned attribute (``torch._C._autograd._top_saved_tensors_...``):
#: covered by the pin of the attribute they lead to.
ON_THE_WAY = {"_autograd", "_functorch", "_dynamo"}


@pytest.fixture(scope="module")
def objects(tmp_path_factory):
    """The objects that carry the pinned attributes, some made on a one-rank gloo group (destroyed afterwards)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import distribute_tensor

    store = tmp_path_factory.mktemp("pins") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        module = torch.nn.Linear(4, 3)
        ignored = torch.nn.Linear(4, 3)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(ignored, ["weight"])
        cpu = torch.device("cpu")
        flat_wrapped = FullyShardedDataParallel(torch.nn.Linear(4, 3), use_orig_params=False, device_id=cpu)
        view_wrapped = FullyShardedDataParallel(torch.nn.Linear(4, 3), use_orig_params=True, device_id=cpu)
        yield {
            "ddp": DistributedDataParallel(torch.nn.Linear(4, 3)),
            "ignored": ignored.weight,
            "flat": next(flat_wrapped.parameters()),
            "view": view_wrapped.module.weight,
            "dtensor": distribute_tensor(torch.zeros(2, 3), init_device_mesh("cpu", (1,))),
            "tensor": torch.zeros(2),
            "optimizer": torch.optim.SGD(module.parameters(), lr=0.1),
            "module": module,
            "state_dict": module.state_dict(),
            "mha": torch.nn.MultiheadAttention(4, 2),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("pin", PINS, ids=[p.what for p in PINS])
def test_torch_still_has_every_private_attribute_the_library_reads(pin, objects):
    pin.check(pin.where(objects))


class _Bare:
    """A stand-in without any of the pinned attributes, for torch objects whose attributes cannot be deleted."""


@pytest.mark.parametrize("pin", PINS, ids=[p.what for p in PINS])
def test_companion_a_missing_attribute_fails_with_its_one_sentence(pin, objects, monkeypatch):
    holder = pin.where(objects)
    try:
        monkeypatch.delattr(holder, pin.name)
    except (AttributeError, TypeError):  # a C type's descriptor (Tensor._version): a stand-in lacks it the same way
        holder = _Bare()
    with pytest.raises(AssertionError) as err:
        pin.check(holder)
    message = str(err.value).split("\n")[0]
    assert message == pin.sentence()
    assert message.count(". ") == 0 and message.endswith("update that guard.")  # one sentence
    assert pin.reader in message and pin.what in message


# ---------------------------------------------------------------------------- what the attributes mean
def test_ddp_marks_its_forward_with_active_ddp_module(objects):
    ddp, seen = objects["ddp"], []
    handle = ddp.module.register_forward_pre_hook(lambda *_: seen.append(DistributedDataParallel._active_ddp_module))
    try:
        ddp(torch.zeros(1, 4))
    finally:
        handle.remove()
    assert seen == [ddp], (f"torch {torch.__version__} no longer sets DistributedDataParallel._active_ddp_module "
                           f"to the DDP inside its forward, which integrations/ddp.py reads; update that guard.")
    assert DistributedDataParallel._active_ddp_module is None  # and clears it afterwards


def test_ddp_lists_the_parameters_it_registered(objects):
    ddp = objects["ddp"]
    assert {id(p) for p in ddp._module_parameters} == {id(p) for p in ddp.module.parameters()}, (
        f"torch {torch.__version__} no longer lists a DDP's parameters in _module_parameters, which "
        f"integrations/ddp.py compares a converted weight's frames with; update that guard.")


def test_saved_tensor_hooks_are_seen_only_inside_saved_tensors_hooks():
    from geoopt_stiefel_attention.integrations.activation_checkpointing import saved_tensor_hooks_active

    outside = saved_tensor_hooks_active()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        inside = saved_tensor_hooks_active()
    assert (outside, inside) == (False, True), (
        f"torch {torch.__version__}'s _top_saved_tensors_default_hooks no longer tells whether saved-tensor hooks "
        f"are active, which integrations/activation_checkpointing.py reads; update that guard.")


def test_parametrize_cache_flags_are_set_only_inside_cached():
    linear = torch.nn.Linear(3, 3)
    parametrize.register_parametrization(linear, "weight", torch.nn.Identity())
    outside = (parametrize._cache_enabled, bool(parametrize._cache))
    with parametrize.cached():
        empty = (parametrize._cache_enabled, bool(parametrize._cache))
        linear.weight  # noqa: B018 - a read fills the cache
        read = bool(parametrize._cache)
    assert (outside, empty, read) == ((0, False), (1, False), True), (
        f"torch {torch.__version__}'s parametrize._cache_enabled/_cache no longer mark a parametrize.cached() block "
        f"with a weight read, which optim/_base.py (integrations/parametrize.py) reads; update that guard.")


# ---------------------------------------------------------------------------- the pins cover the package
def private_torch_names(root: Path = PACKAGE) -> set[str]:
    """Every ``_``-prefixed name the package's source reads from torch: attributes of expressions rooted at
    ``torch`` or a torch alias (``torch._assert_async``, ``_parametrize._cache``), ``_``-prefixed attributes of other
    objects (``module._parameters``) and names given to ``getattr``/``hasattr``; not what ``self``/``cls``/``super()``
    read, nor attributes of the package's own modules imported under a private alias (``_linalg.polar``)."""
    found: set[str] = set()
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and re.fullmatch(r"_[a-z]\w*", node.attr):
                base = node.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and base.id in ("self", "cls", "super"):
                    continue
                if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                    continue
                if isinstance(node.value, ast.Name) and node.value.id.startswith("_") and not (
                        node.value.id.startswith(("_torch", "_parametrize", "_DDP"))):
                    continue  # the package's own modules imported under a private alias (_linalg, _guard, ...)
                found.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                  and re.fullmatch(r"_[a-z]\w*", node.args[1].value)):
                found.add(node.args[1].value)
    return found


def unpinned(root: Path = PACKAGE, pins: list[Pin] = PINS) -> set[str]:
    """The private torch names the package reads that no pin covers."""
    return private_torch_names(root) - NOT_TORCH - ON_THE_WAY - {p.name for p in pins}


def test_every_private_torch_attribute_the_package_reads_is_pinned():
    names = private_torch_names()
    assert {"_active_ddp_module", "_module_parameters", "_cache_enabled", "_version"} <= names  # the scan sees them
    assert unpinned() == set(), "pin these in tests/test_integrations_pins.py"


def test_companion_an_unpinned_private_attribute_is_found(tmp_path):
    pkg = tmp_path / "tiny"
    pkg.mkdir()
    (pkg / "a.py").write_text("import torch\n\ndef f(m, p):\n    x = torch._some_private_op\n"
                              "    return getattr(p, '_another_mark', None), m._hidden_registry, x\n")
    assert unpinned(pkg) == {"_some_private_op", "_another_mark", "_hidden_registry"}
    assert unpinned(pkg, [*PINS, Pin("x", "_hidden_registry", "a.py", "test", _module(torch))]) == {
        "_some_private_op", "_another_mark"}
