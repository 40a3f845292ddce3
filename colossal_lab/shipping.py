"""Function shipping: how ``Cluster.run`` sends a notebook function and its arguments to the ranks.

ipyparallel sends a function by its code and, for one defined in the notebook (``__main__``),
runs it with the rank's namespace as globals, so a helper from an earlier cell, a constant or
``np`` from ``import numpy as np`` is a ``NameError`` on every rank. Here such a function goes
**by value** with cloudpickle (what Ray and loky use): the function, the helpers it calls, the
constants, closures and lambdas it uses, with modules and importable functions referred to by
name. A function the ranks can import goes the way ipyparallel sends it (by reference) and runs
with its module's globals. Arguments go through cloudpickle too.

Built on:

* **cloudpickle** pickles by value (``CloudPickler``); our pickler only adds that the
  notebook's IPython shell becomes the rank's own shell (a shell cannot be pickled).
* **ipyparallel canning**: every value travels wrapped in a ``CannedObject`` (``Shipped``),
  which ipyparallel passes through its own serialization untouched, sends large buffers of as
  separate frames, and unwraps on the rank with the rank's namespace at hand. We do not call
  ``use_cloudpickle()``, which switches serialization for the whole kernel and every engine
  (results included), must be redone after each restart, and would cut shipped functions off
  from names that exist only on the ranks.
* **linecache**: the notebook cells a shipped function comes from are sent along and put in the
  rank's ``linecache``, so rank tracebacks show the cell's lines as the notebook does.

Two halves, one per side of the wire:

* notebook side, ``Call``: each value pickled **once** for all ranks, before any rank is sent
  anything, so an object that cannot be pickled is reported by name (the argument, or the
  global / closure variable / default of the function or of a helper it calls) with nothing
  started.
* rank side, ``Shipped.get_object`` and ``ipython_object``: run on the engine while ipyparallel
  unpacks the apply message. The ranks import this module to unpickle them, so it imports only
  the standard library and ipyparallel (which every engine has) at the top; cloudpickle and
  IPython are imported where they are used.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import sys
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

from ipyparallel.serialize.canning import CannedObject

# ---------------------------------------------------------------------- notebook side

class Call:
    """A ``run`` call's function and arguments, pickled once for every rank.

    The function goes by value (cloudpickle) unless the ranks can import it; every argument
    goes through cloudpickle, except ipyparallel's own canned objects (``ipyparallel.Reference``
    resolves a name on the rank, as ipyparallel documents). ``fn``/``args``/``kwargs`` give
    fresh wrappers per rank because ipyparallel takes large buffers out of the one it sends.
    """

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: Dict[str, Any]):
        if not callable(fn):
            raise TypeError(f"cluster.run: {fn!r} is not callable")
        self._fn = fn if _ships_by_reference(fn) else _pickled(fn, _describe_fn(fn))
        self._args = [a if isinstance(a, CannedObject) else _pickled(a, f"args[{i}]")
                      for i, a in enumerate(args)]
        self._kwargs = {k: v if isinstance(v, CannedObject) else _pickled(v, f"kwargs[{k!r}]")
                        for k, v in kwargs.items()}

    @staticmethod
    def _unpack(item: Any, called: bool = False) -> Any:
        return Shipped(*item, called=called) if isinstance(item, _Pickled) else item

    def fn(self) -> Any:
        return self._unpack(self._fn, called=True)

    def args(self) -> list:
        return [self._unpack(a) for a in self._args]

    def kwargs(self) -> Dict[str, Any]:
        return {k: self._unpack(v) for k, v in self._kwargs.items()}


class _Pickled(tuple):
    """(payload, out-of-band buffers, fill, sources): the arguments of a ``Shipped``."""


def _ships_by_reference(fn: Any) -> bool:
    """True for a plain function whose module the ranks can import by name (they get the
    notebook's ``sys.path`` and working directory): ipyparallel sends it with that module's
    globals. Not for ``__main__`` (the notebook) or a module made at run time."""
    if not isinstance(fn, (types.FunctionType, types.BuiltinFunctionType)):
        return False
    name = getattr(fn, "__module__", None)
    if not name or name == "__main__":
        return False
    module = sys.modules.get(name)
    return module is not None and (getattr(module, "__file__", None) is not None
                                   or getattr(module, "__spec__", None) is not None)


def _by_value_function(obj: Any) -> Optional[types.FunctionType]:
    """The function cloudpickle will send by value in ``obj`` (itself, or the function inside a
    partial or bound method), or None."""
    if isinstance(obj, functools.partial):
        obj = obj.func
    if isinstance(obj, types.MethodType):
        obj = obj.__func__
    if isinstance(obj, types.FunctionType) and not _ships_by_reference(obj):
        return obj
    return None


@functools.lru_cache(maxsize=None)
def _pickler_class():
    """cloudpickle's pickler, except that

    * the notebook's IPython shell (and its bound methods, such as the ``get_ipython`` in every
      notebook's namespace) becomes the rank's own shell: a shell cannot be pickled, and on a rank
      ``get_ipython()`` must mean that rank's;
    * code keeps its file name: cloudpickle 3.1 renames all code it sends by value to
      ``<dynamic-code>`` (for payloads that do not depend on where a function was defined), which
      would cut a rank's traceback off the notebook cell's lines sent along with it.

    Built on first use, so importing this module needs no cloudpickle."""
    import cloudpickle

    class _Pickler(cloudpickle.CloudPickler):
        shell: Any = None

        def reducer_override(self, obj):
            shell = self.shell
            if shell is not None:
                if obj is shell:
                    return ipython_object, (None,)
                if type(obj) is types.MethodType and obj.__self__ is shell:
                    return ipython_object, (obj.__func__.__name__,)
            if type(obj) is types.CodeType:
                return _named_code(self.dispatch_table[types.CodeType](obj), obj.co_filename)
            return super().reducer_override(obj)

    return _Pickler, cloudpickle.DEFAULT_PROTOCOL


def _named_code(reduced: tuple, filename: str) -> tuple:
    """cloudpickle's reduction of a code object, with its file name put back where it wrote its own
    placeholder (``<dynamic-code>``; none in releases that keep the name)."""
    make, args, *rest = reduced
    args = tuple(filename if a == "<dynamic-code>" else a for a in args)
    return (make, args, *rest)


def _dumps(obj: Any) -> Tuple[bytes, list]:
    """cloudpickle ``obj``; large buffers that support it (numpy arrays) stay out of band."""
    buffers: list = []
    f = io.BytesIO()
    pickler, protocol = _pickler_class()
    p = pickler(f, protocol=max(5, protocol), buffer_callback=buffers.append)
    ipython = sys.modules.get("IPython")
    p.shell = ipython.get_ipython() if ipython is not None else None
    p.dump(obj)
    return f.getvalue(), [b.raw() for b in buffers]


def _pickled(obj: Any, what: str) -> _Pickled:
    try:
        payload, buffers = _dumps(obj)
    except Exception as e:  # noqa: BLE001 - any pickling failure is reported the same way
        raise TypeError(_cannot_ship(obj, what, e)) from e
    fn = _by_value_function(obj)
    return _Pickled((payload, buffers, fn is not None, _cell_sources(fn) if fn is not None else {}))


def _cell_sources(fn: types.FunctionType) -> Dict[str, List[str]]:
    """Lines of the notebook cells that a by-value function and the helpers it calls were
    defined in (IPython keeps them in ``linecache``; there is no file a rank could read)."""
    import linecache

    sources: Dict[str, List[str]] = {}
    todo, seen = [fn], set()
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        filename = f.__code__.co_filename
        if filename not in sources and not os.path.exists(filename):
            lines = linecache.getlines(filename) or _history_lines(f.__code__)
            if lines:
                sources[filename] = lines
        todo += [h for h in map(_by_value_function, _referenced(f)) if h is not None]
    return sources


def _history_lines(code: types.CodeType) -> List[str]:
    """The lines of the notebook cell ``code`` was compiled from, found in IPython's input history, for when
    ``linecache`` no longer holds them (anything in the kernel may call ``linecache.clearcache()``: tornado's
    templates do). The cell is the newest one whose compiled text holds the same code at the same line
    (names are no key: the shell names a cell by a hash of its raw text, which the history keeps stripped)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    cells = getattr(getattr(shell, "history_manager", None), "input_hist_parsed", None)
    for text in reversed(cells or []):
        if not code.co_name.startswith("<") and code.co_name not in text:
            continue
        try:
            compiled = compile(text, code.co_filename, "exec", dont_inherit=True)
        except (SyntaxError, ValueError):
            continue
        if _holds(compiled, code):
            return (text + "\n").splitlines(keepends=True)
    return []


def _holds(compiled: types.CodeType, code: types.CodeType) -> bool:
    """Whether ``compiled`` or code nested in it is ``code``: same name, lines, arguments and names read
    (not the bytecode, which differs with how the shell compiled the cell, e.g. from a transformed tree)."""
    if _signature(compiled) == _signature(code):
        return True
    return any(isinstance(c, types.CodeType) and _holds(c, code) for c in compiled.co_consts)


def _signature(code: types.CodeType) -> tuple:
    lines = sorted({line for *_, line in code.co_lines() if line is not None})
    return code.co_name, code.co_firstlineno, tuple(lines), code.co_names, code.co_varnames


def _referenced(fn: types.FunctionType) -> list:
    """The values a function's code can reach by name: globals it reads, closure cells."""
    values = [fn.__globals__[n] for n in _code_names(fn.__code__) if n in fn.__globals__]
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    return values


_SHIP_FIX = ("Objects such as locks, open files, sockets, generators or process groups cannot "
             "be sent: create them inside the function (it runs on every rank), or pass "
             "something picklable they can be made from.")


def _cannot_ship(obj: Any, what: str, err: Exception) -> str:
    """One message naming what could not be pickled (the argument, or the global / closure
    variable / default of the shipped function or of a helper it calls) and the fix."""
    fn = _by_value_function(obj)
    found = _culprit(fn, set()) if fn is not None else None
    if found is not None:
        where, err = found
        head = f"cannot send {what} to the ranks: {where} cannot be pickled"
    else:
        head = f"{what} (a {type(obj).__name__}) cannot be pickled to send it to the ranks"
    return f"cluster.run: {head} ({type(err).__name__}: {err}). {_SHIP_FIX}"


def _describe_fn(fn: Any) -> str:
    inner = _by_value_function(fn)
    return f"the function {getattr(inner or fn, '__qualname__', type(fn).__name__)}()"


def _code_names(code: types.CodeType) -> List[str]:
    """Global names a code object (and the code nested in it) may read, in order."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += [n for n in _code_names(const) if n not in names]
    return names


def _culprit(fn: types.FunctionType, seen: set) -> Optional[Tuple[str, Exception]]:
    """The first value a by-value function refers to that cannot be pickled, described as
    "global 'x' of f()" (following helpers it calls), with the pickling error."""
    if id(fn) in seen:
        return None
    seen.add(id(fn))
    owner = f"{fn.__qualname__}()"
    code = fn.__code__
    values = [(f"global {n!r} of {owner}", fn.__globals__[n]) for n in _code_names(code)
              if n in fn.__globals__]
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            values.append((f"closure variable {name!r} of {owner}", cell.cell_contents))
        except ValueError:  # an empty cell (a name assigned later in the enclosing function)
            pass
    values += [(f"a default argument of {owner}", v) for v in fn.__defaults__ or ()]
    values += [(f"the default of {k!r} of {owner}", v) for k, v in (fn.__kwdefaults__ or {}).items()]
    for where, value in values:
        helper = _by_value_function(value)
        if helper is not None:
            found = _culprit(helper, seen)
            if found is not None:
                return found
            continue
        try:
            _dumps(value)
        except Exception as e:  # noqa: BLE001
            return where, e
    return None


# ---------------------------------------------------------------------- rank side

class Shipped(CannedObject):
    """One value of a ``Cluster.run`` call, pickled once in the notebook by cloudpickle.

    ipyparallel passes ``CannedObject`` instances through its own canning untouched, sends
    large ``buffers`` as separate frames (the payload is not pickled again per rank) and, on
    the rank, calls ``get_object`` with the rank's interactive namespace. ``fill`` is set for a
    function shipped by value: names it uses that the notebook did not define are then taken
    from that namespace (where ``push`` and ``%%colossal`` put them), as ipyparallel's own
    route (which runs such functions with the rank's namespace as globals) would find them.
    The function gets a copy of those names: the rank's namespace itself is not changed.
    ``sources`` are the notebook cells the shipped code comes from (filename -> lines), added
    to the rank's ``linecache`` so its tracebacks show the cell's lines, as they do in the
    notebook. ``called``: this is the function the call runs, which the rank gets wrapped by
    :func:`_reporting` (its error's traceback rendered at once).
    """

    def __init__(self, payload: bytes, buffers: List[Any], fill: bool,
                 sources: Optional[Dict[str, List[str]]] = None, called: bool = False):
        self.buffers = [payload, *buffers]
        self.fill = fill
        self.sources = sources or {}
        self.called = called

    def get_object(self, g: Optional[Dict[str, Any]] = None) -> Any:
        import linecache

        for filename, lines in self.sources.items():
            # an mtime of None: linecache.checkcache keeps the entry (there is no file to check)
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        payload, *out_of_band = self.buffers
        obj = pickle.loads(payload, buffers=out_of_band)
        ns = _shipped_globals(obj) if self.fill else None
        if ns is not None and g is not None:
            for name, value in g.items():
                if name not in ns:
                    ns[name] = value
        return _reporting(obj) if self.called and callable(obj) else obj


def _reporting(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, interruptible only while it runs, whose error gets its traceback rendered as it is raised.

    After one rank fails the notebook interrupts the ranks still busy. The engine's message handler takes
    SIGINT as ``KeyboardInterrupt`` from start to end, so a rank that has just finished (its own error being
    formatted: IPython parses and highlights each frame's source, not instant on a loaded machine; or its
    reply being sent) would be interrupted in the middle and send a traceback without the cell's lines, or
    no reply at all (then the notebook restarts the cluster). Here SIGINT is ignored from the moment ``fn``
    returns or raises until the handler ends (the kernel then puts its own handler back), and the error is
    rendered (IPython's own format, from ``fn``'s frame on) before it leaves: the lines ride on the
    exception as ``_render_traceback_``, which IPython's ``showtraceback`` (what the engine's error reply
    is made of) uses as they are."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            _ignore_interrupts()
            _render_now(e)
            raise
        finally:
            _ignore_interrupts()

    return call


def _ignore_interrupts() -> None:
    """SIGINT ignored for the rest of the engine's message handler (which set ``default_int_handler``)."""
    import signal
    import threading

    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _render_now(e: BaseException) -> None:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or hasattr(e, "_render_traceback_") or e.__traceback__ is None:
        return
    try:
        # from the shipped function's frame on: tb_next skips this wrapper's frame, and no offset (the shell's
        # own skips the frame that runs a cell)
        lines = shell.InteractiveTB.structured_traceback(type(e), e, e.__traceback__.tb_next, tb_offset=0)
    except Exception:  # noqa: BLE001 - the shell formats it later, as it would have
        return
    e._render_traceback_ = lambda: list(lines)


def _shipped_globals(obj: Any) -> Optional[Dict[str, Any]]:
    """The globals dict of a function shipped by value (or of the function inside a partial
    or bound method)."""
    if isinstance(obj, functools.partial):
        obj = obj.func
    if isinstance(obj, types.MethodType):
        obj = obj.__func__
    return obj.__globals__ if isinstance(obj, types.FunctionType) else None


def ipython_object(attr: Optional[str]) -> Any:
    """This rank's IPython shell, or one of its bound methods (``get_ipython``): what a
    notebook function's reference to the notebook's own shell means on a rank."""
    from IPython import get_ipython

    shell = get_ipython()
    return shell if attr is None else getattr(shell, attr)
