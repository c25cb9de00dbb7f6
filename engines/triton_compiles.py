"""Triton compiles in this process: how many, and how many after the start-up warm-up.

A Triton kernel compiles on the first launch of each *specialisation*: its compile-time constants,
its launch options, the dtype of each tensor argument and, unless told not to, whether each integer
argument is 1 or divisible by 16 and whether each pointer is 16-byte aligned. A compile runs
Triton's front end, LLVM and ptxas on the host inside the launch: one inside a served step is a
latency spike that no scheduler predicted. A server warms every variant it can launch before it
reports ready (`engines.kernel_warmup`), so the goal is **0 compiles while serving**. Two tools
check it:

* `launch_key(kernel, args, options)`: the key Triton's JIT cache files a launch under, computed
  with Triton's own specialisation routine and without a GPU (the tests compare the keys of every
  step a configuration can take with the keys the warm-up launched);
* `COUNTER` (`CompileCounter.install()`): Triton's JIT cache-miss hook, chained after any hook
  already set, counts every compile of this process, and those after `mark_serving()` apart, with
  the kernels they were for. Triton calls the hook on a GPU only (its interpreter compiles
  nothing)."""

from __future__ import annotations

import inspect
import logging
import threading
from dataclasses import dataclass, field

log = logging.getLogger("engines.triton_compiles")
KEEP_NAMES = 20  # kernels named after warm-up: enough to say which, bounded for a long run


_PARAMS: dict[int, tuple[object, list]] = {}  # id(kernel) -> (kernel, its parameters): a launch asks per step


def _params(kernel) -> list[tuple[str, bool, bool, bool]]:
    """(name, is constexpr, specialise on value, specialise on alignment) per parameter of a
    `triton.jit` kernel, compiled or interpreted (the interpreter keeps the decorator's options)."""
    held = _PARAMS.get(id(kernel))
    if held is not None and held[0] is kernel:
        return held[1]
    fn = getattr(kernel, "fn", kernel)
    options = getattr(kernel, "kwargs", {})  # an InterpretedFunction's decorator options
    no_value = set(getattr(kernel, "do_not_specialize", None) or options.get("do_not_specialize") or ())
    no_align = set(getattr(kernel, "do_not_specialize_on_alignment", None)
                   or options.get("do_not_specialize_on_alignment") or ())
    out = []
    for i, p in enumerate(inspect.signature(fn).parameters.values()):
        constexpr = "constexpr" in str(p.annotation)
        out.append((p.name, constexpr, i not in no_value and p.name not in no_value,
                    i not in no_align and p.name not in no_align))
    _PARAMS[id(kernel)] = (kernel, out)
    return out


def launch_key(kernel, args: dict, options: dict | None = None) -> tuple:
    """What Triton's JIT cache keys this launch by (less the device): the kernel, per parameter its
    constexpr value or its specialisation (type and divisibility / alignment, as Triton's own
    `native_specialize_impl` gives it) and the launch options. Two launches with equal keys share
    one compiled kernel. `args` maps every parameter name to its value (constexprs included)."""
    from triton._C.libtriton import native_specialize_impl  # deferred: triton is optional
    from triton.backends.compiler import BaseBackend

    spec = []
    for name, constexpr, value, align in _params(kernel):
        if name not in args:
            raise KeyError(f"{getattr(kernel, '__name__', kernel)}: no value for parameter {name}")
        arg = args[name]
        if constexpr:
            spec.append((name, "constexpr", str(arg)))
        else:
            spec.append((name, *native_specialize_impl(BaseBackend, arg, False, value, align)))
    name = getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))
    return (name, tuple(spec), tuple(sorted((options or {}).items())))


@dataclass
class CompileCounter:
    """Counts this process's Triton compiles (JIT cache misses) once installed."""

    total: int = 0
    serving: int = 0  # after mark_serving()
    serving_kernels: list[str] = field(default_factory=list)  # the first KEEP_NAMES compiled while serving
    installed: bool = False
    is_serving: bool = False
    _previous: object = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self) -> bool:
        """Chain the counter into Triton's cache-miss hook; False where triton does not import or
        runs interpreted (nothing compiles there). Idempotent."""
        if self.installed:
            return True
        try:
            from triton import knobs  # deferred: triton is optional
        except ImportError:
            return False
        if knobs.runtime.interpret:
            return False
        self._previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._on_miss
        self.installed = True
        return True

    def mark_serving(self) -> None:
        """From now on compiles count as compiles while serving (call it after the warm-up)."""
        self.is_serving = True

    def _on_miss(self, **kwargs):
        """Triton's `jit_cache_hook` (called by keyword: key, repr, fn, compile, ...) before each
        compile; returns what a hook set before this one returns (True would skip the compile,
        which only that hook may decide)."""
        fn, text = kwargs.get("fn"), kwargs.get("repr")
        name = getattr(fn, "name", None) or str(text or "?")
        with self._lock:
            self.total += 1
            if self.is_serving:
                self.serving += 1
                first = name not in self.serving_kernels
                if first and len(self.serving_kernels) < KEEP_NAMES:
                    self.serving_kernels.append(name)
            else:
                first = False
        if first:  # once per kernel: a serving loop must not log per compile
            log.warning("Triton compiled %s while serving (a variant the start-up warm-up did not launch): %s",
                        name, text)
        previous = self._previous
        return previous(**kwargs) if callable(previous) else None

    def mark_warming(self) -> None:
        """Compiles count as a warm-up's again, until the next mark_serving() (a benchmark that
        builds several models in one process warms each one)."""
        self.is_serving = False

    def snapshot(self) -> dict:
        return {"installed": self.installed, "total": self.total, "while_serving": self.serving,
                "before_serving": self.total - self.serving, "serving_kernels": list(self.serving_kernels)}


COUNTER = CompileCounter()  # one per process: Triton's hook is process-wide
