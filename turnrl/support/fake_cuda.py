"""A stand-in CUDA device for machines without one: code that must run on a GPU is checked on the CPU.

Under ``fake_cuda()``, a tensor moved to ``cuda`` (``.to("cuda")``, ``.cuda()``, a factory's
``device="cuda"``, or any result computed from such a tensor) stays in CPU memory and computes on
the CPU, but reports ``cuda:0`` as its device. Every torch call is checked the way CUDA checks it:
a call that mixes a tensor on the fake device with a CPU tensor fails with CUDA's own message
("Expected all tensors to be on the same device"), except where CUDA allows it (a 0-dim CPU
tensor as a scalar operand, CPU indices into a device tensor, copies across devices), and
``.numpy()`` of a device tensor fails as it does on CUDA. A CPU tensor made without a device
(``torch.arange(n)``, ``torch.rand(..., generator=cpu_generator)``) and used with the model's
tensors is the classic GPU-only bug; under this mode it fails on the CPU, in CI.

Threads started within the block (an engine's worker, ``asyncio.to_thread``'s pool) run under
the mode too. Parameters move in place (``model.to("cuda")`` keeps the module's parameter
objects, as it does on a GPU); other tensors are copied, as ``.to`` copies across devices.
``torch.cuda`` itself is not faked: ``torch.cuda.is_available()`` stays False, so code that asks
it takes its CPU branch.

    with fake_cuda():
        model.to("cuda")
        ...  # the code under test, unchanged
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["FAKE_CUDA", "MixedDeviceError", "fake_cuda", "on_fake_cuda"]

FAKE_CUDA = torch.device("cuda", 0)
_CPU = torch.device("cpu")
_TAG = "_turnrl_fake_cuda"
# calls that take tensors on either device by design (CUDA copies or indexes across devices)
_CROSS = {torch.Tensor.copy_, torch.Tensor.__setitem__}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.index_put_, torch.Tensor.index_put}


class MixedDeviceError(RuntimeError):
    """A torch call mixed a (fake) CUDA tensor with a CPU tensor, which fails on a real GPU."""


def on_fake_cuda(t: torch.Tensor) -> bool:
    """Whether ``t`` is on the fake CUDA device."""
    return bool(getattr(t, _TAG, False))


def _tag(t: torch.Tensor, on: bool) -> torch.Tensor:
    setattr(t, _TAG, on)
    return t


def _wants_cuda(device: Any) -> bool | None:
    """Whether a device argument names CUDA (None: it is not a device argument)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return torch.device(device).type == "cuda"
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare index is a CUDA ordinal
    return None


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in an argument or a result: itself, or those in a list, tuple or dict (one level
    deep, as torch's own signatures nest them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        yield from (v for v in value if isinstance(v, torch.Tensor))
    elif isinstance(value, dict):
        yield from (v for v in value.values() if isinstance(v, torch.Tensor))


def _mixed(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The message CUDA would fail this call with, or None when its tensors share a device."""
    if func in _CROSS:
        return None
    if func in _INDEXING:  # CPU indices may index a device tensor, not the other way round
        if args and isinstance(args[0], torch.Tensor) and not on_fake_cuda(args[0]):
            rest = [t for a in args[1:] for t in _tensors(a)]
            if any(on_fake_cuda(t) for t in rest):
                return "indices should be either on cpu or on the same device as the indexed tensor (cpu)"
        return None
    found = [t for a in (*args, *kwargs.values()) for t in _tensors(a)]
    fake = [t for t in found if on_fake_cuda(t)]
    host = [t for t in found if not on_fake_cuda(t) and t.dim() > 0]  # CUDA takes 0-dim CPU scalars
    if fake and host:
        name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
        return (
            f"{name}: Expected all tensors to be on the same device, but found at least two devices, "
            f"cuda:0 and cpu! (a CPU tensor of shape {tuple(host[0].shape)})"
        )
    return None


def _move(t: torch.Tensor, cuda: bool, out: torch.Tensor) -> torch.Tensor:
    """``out`` (``t`` converted) on the fake device or the CPU: a parameter moves in place, any
    other tensor that changes device is a copy."""
    if isinstance(t, torch.nn.Parameter) and out is t:
        return _tag(t, cuda)
    if out is t and on_fake_cuda(t) != cuda:
        out = t.clone()
    return _tag(out, cuda)


def _to(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """``Tensor.to`` with a fake CUDA target run on the CPU."""
    t, rest = args[0], list(args[1:])
    device = kwargs.pop("device", None)
    if rest and isinstance(rest[0], torch.Tensor):  # .to(other): other's device and dtype
        other = rest.pop(0)
        device, rest = (FAKE_CUDA if on_fake_cuda(other) else _CPU), [other.dtype, *rest]
    elif rest and _wants_cuda(rest[0]) is not None:
        device = rest.pop(0)
    cuda = _wants_cuda(device)
    if cuda is None or device is None:
        out = torch.Tensor.to(t, *rest, **kwargs)
        return _tag(out, True) if on_fake_cuda(t) and out is not t else out
    out = torch.Tensor.to(t, _CPU if cuda else device, *rest, **kwargs)
    return _move(t, cuda, out)


class _FakeCudaMode(TorchFunctionMode):
    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if getattr(func, "__name__", "") == "__get__":  # a property: .device, .is_cuda...
            prop = getattr(getattr(func, "__self__", None), "__name__", "")
            if prop == "device":
                return FAKE_CUDA if on_fake_cuda(args[0]) else func(*args)
            if prop == "is_cuda":
                return on_fake_cuda(args[0])
            if prop == "is_cpu":
                return not on_fake_cuda(args[0]) and func(*args)
        if func is torch.Tensor.to:
            return _to(args, kwargs)
        if func is torch.Tensor.cuda:
            return _move(args[0], True, args[0])
        if func is torch.Tensor.cpu:
            return _move(args[0], False, args[0]) if on_fake_cuda(args[0]) else args[0]
        if func is torch.Tensor.get_device:
            return 0 if on_fake_cuda(args[0]) else func(*args)
        if func is torch.Tensor.__deepcopy__:  # its memo holds copies already made, on any device
            return _tag(func(*args, **kwargs), on_fake_cuda(args[0]))
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.numpy and on_fake_cuda(args[0]):
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() first.")
        target = _wants_cuda(kwargs.get("device"))
        if target:
            kwargs["device"] = _CPU
        elif target is None and (message := _mixed(func, args, kwargs)):
            raise MixedDeviceError(message)
        out = func(*args, **kwargs)
        first = args[0] if args else None
        if target is None:
            if isinstance(first, torch.Tensor) and out is first:
                return out  # in place: the tensor stays where it is
            target = any(on_fake_cuda(t) for a in (*args, *kwargs.values()) for t in _tensors(a))
        if target:
            for t in _tensors(out):
                _tag(t, True)
        return out


@contextmanager
def fake_cuda() -> Iterator[None]:
    """Within: ``cuda`` is a device that computes on the CPU and fails on mixed devices as CUDA
    does, in this thread and in every thread started within (torch's modes are per thread)."""
    bootstrap = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def under_mode(thread: threading.Thread) -> None:
        with _FakeCudaMode():
            bootstrap(thread)

    make_subclass = torch.Tensor._make_subclass

    def subclass_on_its_device(cls: type, data: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``nn.Parameter(t)`` (a deep copy of a model makes them) is where ``t`` is."""
        return _tag(make_subclass(cls, data, *args, **kwargs), on_fake_cuda(data))

    threading.Thread._bootstrap_inner = under_mode  # type: ignore[attr-defined]
    torch.Tensor._make_subclass = staticmethod(subclass_on_its_device)  # type: ignore[assignment]
    try:
        with _FakeCudaMode():
            yield
    finally:
        threading.Thread._bootstrap_inner = bootstrap  # type: ignore[attr-defined]
        torch.Tensor._make_subclass = make_subclass  # type: ignore[method-assign]
