"""Error feedback: a residual memory keyed by tensor name, separate from compressors."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..buffers import from_torch, inspect, to_torch
from .base import charge

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Keeps, per tensor name, what compression has not yet transmitted.

    One step of error-fed compression (EF-SGD; also the residual of DGC, EF-SignSGD,
    PowerSGD and AR-Top-k)::

        g_c = ef.compensate(name, g)              # g + e      (e = 0 the first time)
        payload = compressor.compress(g_c, name=name, step=step)
        sent = compressor.decompress(payload)     # what this rank contributed
        ef.update(name, g_c, sent)                # e <- g_c - sent

    Under the virtual clock (:mod:`mpicomm.clock`) ``compensate`` and ``update`` charge
    their elementwise passes as ``reduce`` per byte.

    For sparse compressors, ``ef.update_sparse(name, g_c, indices)`` does the update
    without building the dense ``sent``: it zeros the sent positions of ``g_c`` and keeps
    ``g_c`` itself as the residual.

    Residuals live in the framework, device, dtype and shape of the tensors they belong
    to; a tensor that reappears under the same name with another shape, dtype, framework
    or device raises ``ValueError``.

    Conservation: ``compensated == sent + residual`` holds exactly for sparsifiers (each
    entry is either sent unchanged or kept) and, by Sterbenz's lemma, whenever each sent
    entry is within a factor 2 of the compensated one (casts); otherwise up to one
    rounding of the subtraction.

    Momentum correction (Deep Gradient Compression, Lin et al., ICLR 2018, arXiv
    1712.01887): with ``momentum=m > 0`` the memory also keeps a velocity ``u`` per name and moves
    the optimizer's momentum in front of the compression::

        u = m·u + g                  # compensate(): velocity (u = g the first time)
        v = e + u                    # the accumulator, returned to be compressed
        e = v with the sent positions zeroed     # update_sparse() / update()
        u = u with the sent positions zeroed     # momentum factor masking (masking=True)

    The strategy's output, the mean over ranks of what was sent, is then the update
    itself: ``w <- w - lr·mean_r(sent_r)`` by an optimizer **without momentum** (plain
    SGD; fold weight decay into the gradient, e.g. add ``wd/2·||w||²`` to the loss,
    because an optimizer's decoupled decay would bypass the velocity). Set it up as::

        strategy = GTopK(density=0.001, momentum_correction=0.9)   # DGC: m = 0.9
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0)

    With every entry sent (density 1) and ``masking=False`` this is exactly momentum SGD
    on the averaged gradient (``u`` is the heavy-ball buffer); with masking at density 1
    the velocity is cleared every step, i.e. plain SGD. Masking applies where values were
    sent sparsely (:meth:`update_sparse`); :meth:`update` (dense transmission, e.g. a
    quantizer) leaves the velocity alone. Without momentum (``m = 0``, the default) the
    memory is plain error feedback and keeps no velocity.
    """

    def __init__(self, momentum: float = 0.0, masking: bool = True) -> None:
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or \
                not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
        if not isinstance(masking, bool):
            raise ValueError(f"masking must be True or False, got {masking!r}")
        self.momentum = float(momentum)
        self.masking = masking
        #: With ``True``, :meth:`update_sparse` also keeps ``||compensated[indices]||²``
        #: (what was sent, as a 0-d float64 tensor on the tensor's device: no host
        #: round trip) for :meth:`sent_sq`; off by default (a gather of the ``k`` sent
        #: entries per call). The adaptive strategy turns it on: with it the error-fed
        #: squared norm is ``sent_sq + ||residual||²`` (disjoint supports), one pass over
        #: the buffer instead of forming ``||g + e||²`` beside the strategy.
        self.track_sent = False
        self._residuals: dict[str, Any] = {}
        self._velocities: dict[str, Any] = {}
        self._sent_sq: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ the loop
    def compensate(self, name: str, x: Any) -> Any:
        """``x + residual[name]`` as a new array/tensor (a copy of ``x`` the first time).

        With momentum correction: first ``u = m·u + x`` (stored), then ``u + residual``.
        Call it once per step and name.
        """
        t = to_torch(x).detach()
        charge("reduce", t.numel() * t.element_size() * (2 if self.momentum else 1))
        if self.momentum:
            t = self._advance_velocity(name, x, t)
        held = self._residuals.get(name)
        if held is None:
            out = t.clone()
        else:
            _check_same(name, held, x, "residual", "tensor")
            out = t + to_torch(held)
        return from_torch(out, like=x)

    def update(self, name: str, compensated: Any, transmitted: Any) -> None:
        """Store ``compensated - transmitted`` (``transmitted`` dense, same shape)."""
        _check_same(name, compensated, transmitted, "compensated", "transmitted",
                    dtype=False)
        c = to_torch(compensated).detach()
        charge("reduce", c.numel() * c.element_size())
        sent = to_torch(transmitted).detach().to(device=c.device)
        residual = (c - sent).to(c.dtype)
        self._store(name, from_torch(residual, like=compensated))

    def update_sparse(self, name: str, compensated: Any, indices: Any, *,
                      inplace: bool = True, sent: Any = None) -> None:
        """Residual = ``compensated`` with the flat positions ``indices`` set to zero.

        With ``inplace=True`` (default) ``compensated`` itself is zeroed at ``indices``
        and kept as the residual (no copy): gather the values to send *before* calling
        this, and do not reuse ``compensated`` afterwards. ``inplace=False`` copies.
        ``sent``: the values that reach the other ranks at ``indices`` where they differ
        from ``compensated``'s own there (a lossy wire format); the residual then keeps
        ``compensated[indices] - sent`` at ``indices`` instead of zero.
        With :attr:`track_sent`, ``||sent||²`` (``||compensated[indices]||²`` without
        ``sent``) is kept for :meth:`sent_sq` (``indices`` distinct, as every
        sparsifier's are).
        """
        info = inspect(compensated)
        c = to_torch(compensated).detach()
        if not inplace or not c.is_contiguous():
            c = c.clone()
        i = to_torch(indices).reshape(-1).to(device=c.device, dtype=torch.int64)
        # No host round trip for the range check (reading i.min()/i.max() would wait for
        # the device): a negative index is mapped past the end, so the indexing kernel's
        # own bounds check rejects every bad index (on the CPU as the ValueError below;
        # on CUDA as a device-side assertion at the next synchronization).
        i = torch.where(i < 0, info.numel, i)
        try:
            if sent is None:
                if self.track_sent:
                    own = c.view(-1).index_select(0, i).to(torch.float64)
                    self._sent_sq[name] = torch.dot(own, own)
                c.view(-1).index_fill_(0, i, 0)
            else:
                s = to_torch(sent).reshape(-1).to(device=c.device, dtype=c.dtype)
                if s.shape != i.shape:
                    raise ValueError(f"update_sparse: {s.shape[0]} sent values for "
                                     f"{i.shape[0]} indices of tensor {name!r}")
                if self.track_sent:
                    self._sent_sq[name] = torch.dot(s.to(torch.float64),
                                                    s.to(torch.float64))
                c.view(-1).index_copy_(0, i, c.view(-1).index_select(0, i) - s)
        except IndexError:
            raise ValueError(
                f"update_sparse: index out of range for tensor {name!r} of {info.numel} "
                "elements"
            ) from None
        self._store(name, from_torch(c, like=compensated))
        held = self._velocities.get(name) if self.masking else None
        if held is not None:  # momentum factor masking
            u = to_torch(held)
            u.view(-1).index_fill_(0, i, 0)
            self._velocities[name] = from_torch(u, like=held)

    def _advance_velocity(self, name: str, x: Any, t: Any) -> Any:
        """``u = m·u + t`` for ``name`` (``u = t`` the first time); returns ``u``'s copy."""
        held = self._velocities.get(name)
        if held is None:
            u = t.clone()
        else:
            _check_same(name, held, x, "velocity", "tensor")
            u = to_torch(held)
            u.mul_(self.momentum).add_(t)
        self._velocities[name] = from_torch(u, like=x)
        return u.clone()

    def sent_sq(self, name: str) -> float:
        """``||compensated[indices]||²`` of the last :meth:`update_sparse` of ``name``
        (taken, so one call per update; ``KeyError`` if none was recorded, e.g.
        :attr:`track_sent` off or a dense :meth:`update`)."""
        try:
            return float(self._sent_sq.pop(name))
        except KeyError:
            raise KeyError(f"no sent norm recorded for tensor {name!r} (track_sent is "
                           f"{self.track_sent})") from None

    def velocity(self, name: str) -> Any:
        """The momentum-correction velocity kept for ``name`` (``KeyError`` if none)."""
        try:
            return self._velocities[name]
        except KeyError:
            raise KeyError(f"no velocity stored for tensor {name!r}") from None

    # ------------------------------------------------------------------ access
    def residual(self, name: str) -> Any:
        """The residual kept for ``name`` (``KeyError`` if none was stored yet)."""
        try:
            return self._residuals[name]
        except KeyError:
            raise KeyError(f"no residual stored for tensor {name!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._residuals

    def __len__(self) -> int:
        return len(self._residuals)

    def names(self) -> list[str]:
        """Names with a stored residual, in insertion order."""
        return list(self._residuals)

    def reset(self, name: str | None = None) -> None:
        """Drop the residual of ``name`` (all residuals when None)."""
        if name is None:
            self._residuals.clear()
            self._velocities.clear()
            self._sent_sq.clear()
        else:
            self._residuals.pop(name, None)
            self._velocities.pop(name, None)
            self._sent_sq.pop(name, None)

    def norm(self, name: str | None = None) -> float:
        """L2 norm of one residual, or of all residuals together (a diagnostic).

        The squares are summed on each residual's device; the host reads one number
        per device (a float must come back, but not one per tensor)."""
        items = [self.residual(name)] if name is not None else self._residuals.values()
        sums: dict[Any, torch.Tensor] = {}
        for r in items:
            t = to_torch(r).detach()
            part = torch.sum(t.double() ** 2)
            sums[t.device] = sums[t.device] + part if t.device in sums else part
        return math.sqrt(sum(float(v) for v in sums.values()))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``{"residuals": {name: copy}}`` (plus ``"velocities"`` with momentum
        correction) with copies in each tensor's own framework."""
        state = {"residuals": _copies(self._residuals)}
        if self.momentum:
            state["velocities"] = _copies(self._velocities)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace all residuals by copies of those in ``state`` (from :meth:`state_dict`)."""
        residuals = state["residuals"]
        velocities = state.get("velocities", {})
        if velocities and not self.momentum:
            raise ValueError("the state holds momentum-correction velocities but this "
                             "memory runs without momentum")
        for k, v in [*residuals.items(), *velocities.items()]:
            inspect(v)  # TypeError for anything that is not an array/tensor
            if not isinstance(k, str):
                raise ValueError(f"residual names must be strings, got {k!r}")
        self._residuals = _copies(residuals)
        self._velocities = _copies(velocities)
        self._sent_sq = {}

    def _store(self, name: str, residual: Any) -> None:
        held = self._residuals.get(name)
        if held is not None:
            _check_same(name, held, residual, "residual", "new residual")
        self._residuals[name] = residual


def _copies(tensors: dict[str, Any]) -> dict[str, Any]:
    return {k: from_torch(to_torch(v).detach().clone(), like=v) for k, v in tensors.items()}


def _check_same(name: str, a: Any, b: Any, what_a: str, what_b: str, *,
                dtype: bool = True) -> None:
    ia, ib = inspect(a), inspect(b)
    if ia.shape != ib.shape:
        raise ValueError(
            f"tensor {name!r}: {what_b} has shape {ib.shape}, {what_a} has {ia.shape}"
        )
    fields = ["framework", "device"] + (["dtype"] if dtype else [])
    for f in fields:
        if getattr(ia, f) != getattr(ib, f):
            raise ValueError(
                f"tensor {name!r}: {what_b} is {f} {getattr(ib, f)}, {what_a} is "
                f"{getattr(ia, f)}"
            )
