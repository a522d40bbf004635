"""RRef proxies: ``rref.rpc_sync().method(*args)`` runs the method on the owner (RPC-15)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._future import Future
from ._rref import agent_of, owner_allowlist

if TYPE_CHECKING:
    from ._rref import RRef


def _local_invoke(rref: RRef[Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return _owner_attribute(rref, name)(*args, **kwargs)


def _local_invoke_async(rref: RRef[Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return _owner_attribute(rref, name)(*args, **kwargs)


def _owner_attribute(rref: RRef[Any], name: str) -> Any:
    """The attribute ``name`` of the RRef's value, on its owner. ``name`` comes from a peer: on a
    worker with ``unpickle_allow`` it is checked as a global would be (an allowed method of the value's
    type, never a dunder), so a proxy call reaches nothing the list does not allow; without one, any
    attribute, as PyTorch."""
    allow = owner_allowlist(rref, "the RRef proxy")
    value = rref.local_value()
    return getattr(value, name) if allow is None else allow.attribute(value, name)


_local_invoke_async._wrapped_async_rpc_function = _local_invoke_async  # type: ignore[attr-defined]


class RRefProxy:
    """Turns attribute access into an RPC to the RRef's owner, in one of three modes."""

    def __init__(self, rref: RRef[Any], mode: str, timeout: float) -> None:
        self._rref = rref
        self._mode = mode
        self._timeout = timeout

    def __getattr__(self, name: str) -> Any:
        return _ProxyMethod(self._rref, self._mode, self._timeout, name)


class _ProxyMethod:
    def __init__(self, rref: RRef[Any], mode: str, timeout: float, name: str) -> None:
        self._rref, self._mode, self._timeout, self._name = rref, mode, timeout, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from .rpc import api

        rref, name, timeout = self._rref, self._name, self._timeout
        call = getattr(api, self._mode)

        def invoke(rref_type: type) -> Any:
            attr = getattr(rref_type, name)  # AttributeError("type object 'X' has no attribute 'y'")
            fn = _local_invoke_async if hasattr(attr, "_wrapped_async_rpc_function") else _local_invoke
            return call(rref.owner(), fn, args=(rref, name, args, kwargs), timeout=timeout)

        # The context's cached type future, not the public _get_type(): that one returns whatever
        # its first caller got (a type or a Future), as in PyTorch. On an RRef still being created
        # the owner answers once the value exists (RREF-7).
        type_fut = agent_of(rref).rrefs.get_type(rref, timeout)
        if self._mode != "rpc_async":
            return invoke(type_fut.wait())
        # rpc_async: don't block on the type lookup; chain it.
        out: Future[Any] = Future()

        def on_type(f: Future[type]) -> None:
            try:
                inner = invoke(f.wait())
            except BaseException as exc:
                out.set_exception(exc)
                return
            inner.add_done_callback(lambda g: _forward(g, out))

        type_fut.add_done_callback(on_type)
        return out


def _forward(src: Any, dst: Future[Any]) -> None:
    try:
        value = src.wait()
    except BaseException as exc:
        dst.set_exception(exc)
    else:
        dst.set_result(value)
