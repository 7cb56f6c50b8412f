r"""Modular arithmetic data: every pair :math:`(a, b)` with its answer :math:`(a \circ b) \bmod p`.

Each example is the token sequence ``[a, op, b, =]`` over a vocabulary of ``p + 2`` tokens (``0 .. p-1``
are the residues, ``p`` is the operation token, ``p + 1`` the ``=`` token); the target is the answer, to be
predicted at the last position. The operations:

- ``+``: :math:`(a + b) \bmod p`, ``-``: :math:`(a - b) \bmod p`, ``*``: :math:`(a b) \bmod p`, all pairs
  :math:`0 \le a, b < p` (:math:`p^2` examples);
- ``/``: :math:`(a\, b^{-1}) \bmod p` with :math:`b^{-1}` the multiplicative inverse
  (:math:`b\, b^{-1} \equiv 1`), pairs with :math:`b \ne 0` only (:math:`p(p-1)` examples); ``p`` must be prime.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..harness.batches import STREAM_SPLIT, derived_generator

__all__ = ["OPERATIONS", "ModularSplit", "modular_split", "is_prime", "canonical_operation"]

#: The operations and their accepted spellings.
OPERATIONS = {"+": ("+", "add", "plus"), "-": ("-", "sub", "minus"), "*": ("*", "x", "×", "mul", "times"),
              "/": ("/", "÷", "div")}


def canonical_operation(op: str) -> str:
    """``+``, ``-``, ``*`` or ``/`` for any accepted spelling of an operation; ``ValueError`` otherwise."""
    for canon, spellings in OPERATIONS.items():
        if op in spellings:
            return canon
    raise ValueError(f"operation={op!r} is unknown; use one of + - * / (or add, sub, mul, div) (--operation).")


def is_prime(n: int) -> bool:
    """Whether the int ``n`` is prime (trial division; ``n`` is small here)."""
    if n < 2:
        return False
    k = 2
    while k * k <= n:
        if n % k == 0:
            return False
        k += 1
    return True


@dataclass(frozen=True)
class ModularSplit:
    """A train/validation split of a modular-arithmetic table, as long tensors on the CPU.

    Attributes
    ----------
    train_inputs, val_inputs : torch.Tensor
        ``(n, 4)`` token sequences ``[a, op, b, =]``.
    train_targets, val_targets : torch.Tensor
        ``(n,)`` answers in ``0 .. p-1``.
    """

    p: int
    operation: str
    train_fraction: float
    seed: int
    train_inputs: torch.Tensor
    train_targets: torch.Tensor
    val_inputs: torch.Tensor
    val_targets: torch.Tensor

    @property
    def vocab_size(self) -> int:
        """``p + 2``: the residues, the operation token and ``=``."""
        return self.p + 2

    @property
    def seq_len(self) -> int:
        return 4


def _table(p: int, op: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a = torch.arange(p).repeat_interleave(p)
    b = torch.arange(p).repeat(p)
    if op == "/":
        keep = b != 0
        a, b = a[keep], b[keep]
        inverse = torch.tensor([0] + [pow(k, -1, p) for k in range(1, p)])  # one entry per residue
        c = (a * inverse[b]) % p
    elif op == "+":
        c = (a + b) % p
    elif op == "-":
        c = (a - b) % p
    else:
        c = (a * b) % p
    return a, b, c


def modular_split(p: int = 97, operation: str = "+", train_fraction: float = 0.3, seed: int = 0) -> ModularSplit:
    r"""All pairs of the table of :math:`(a \circ b) \bmod p`, split at random into train and validation.

    The split is a uniformly random permutation drawn from ``seed`` alone; the first
    ``round(train_fraction * n)`` pairs are the training set, the rest the validation set, so every pair is
    in exactly one of them.

    Parameters
    ----------
    p : int, default 97
        The modulus, ``>= 2``; prime for ``operation="/"``.
    operation : str, default "+"
        ``+``, ``-``, ``*`` or ``/`` (see :data:`OPERATIONS` for the other spellings).
    train_fraction : float, default 0.3
        In ``(0, 1)``; both parts must be non-empty.
    seed : int, default 0
        Fixes the split.
    """
    op = canonical_operation(operation)
    if not (isinstance(p, int) and p >= 2):
        raise ValueError(f"modular_split: p={p!r} must be an int >= 2 (the paper uses 97).")
    if op == "/" and not is_prime(p):
        raise ValueError(f"modular_split: operation '/' needs a prime p (every b != 0 invertible), got p={p}.")
    if not (isinstance(train_fraction, float | int) and 0 < train_fraction < 1):
        raise ValueError(f"modular_split: train_fraction={train_fraction!r} must be in (0, 1), e.g. 0.3.")
    a, b, c = _table(p, op)
    n = a.numel()
    n_train = round(train_fraction * n)
    if not 1 <= n_train <= n - 1:
        raise ValueError(f"modular_split: train_fraction={train_fraction} of {n} pairs leaves an empty train or "
                         f"validation set; use a larger p or a fraction nearer 0.5.")
    tokens = torch.stack([a, torch.full_like(a, p), b, torch.full_like(a, p + 1)], dim=1)
    order = torch.randperm(n, generator=derived_generator(STREAM_SPLIT, int(seed)))
    tr, va = order[:n_train], order[n_train:]
    return ModularSplit(p=p, operation=op, train_fraction=float(train_fraction), seed=int(seed),
                        train_inputs=tokens[tr], train_targets=c[tr], val_inputs=tokens[va], val_targets=c[va])
