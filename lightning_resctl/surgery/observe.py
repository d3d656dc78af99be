"""Find residual merges by watching one forward.

A :class:`torch.overrides.TorchFunctionMode` sees every torch call of the forward with its operands.
From it we keep a light dataflow graph (tensor -> producing op -> input tensors) and, for every addition
of two tensors (``a + b``, ``torch.add``, ``a += b``, ``a.add_(b)``), the calling frame: its code object
and the instruction being run, which Python 3.11's ``co_positions`` maps to the exact source expression.

An addition that runs in a plain function (``dropout_add(x, residual, p, training)``, a helper of the user's,
a ``functools.partial`` of one) called from a module's method is attributed to that method: the frames between
are kept as *call sites* (``AddEvent.calls``), so that the call can be redirected, for that call site only, to a
rewritten copy of the function. Code lexically inside the method (a comprehension, a lambda, an inner ``def``)
is part of the method's own source and needs no call site.

Which additions are merges is the next step's decision (:mod:`.classify`).

Writes in place keep the dataflow: an op that writes its input (``add_``, ``index_put_``, ``out=``,
``y[index] = value``, hence ``y[index] += value``) gives that tensor a new node depending on the write, and
so does every other tensor seen on the same storage (a view written through, the tensor a view was taken of).
"""
from __future__ import annotations

import copy
import sys
from types import CodeType, FrameType
from typing import Any, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .events import AddEvent, Node, Observation

__all__ = ["observe", "observe_modes", "run_example", "preserved"]

_ADD_FUNCS = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}
_IADD_FUNCS = {torch.Tensor.add_, torch.Tensor.__iadd__}
# ops whose output does not depend on the *values* of their tensor inputs
_VALUE_FREE = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
               "randint_like", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"}
# ops whose output depends on the values of their first tensor only; the other tensor gives a shape, dtype
# or device (``pos.expand_as(x)`` is not computed from ``x``)
_FIRST_INPUT_ONLY = {"expand_as", "type_as", "view_as", "reshape_as", "to"}
# frames of torch's dispatch glue between the user's expression and the mode
_GLUE_FILES = ("torch/overrides.py", "torch/_tensor.py", "torch/utils/_device.py")
# frames of nn.Module's call machinery: a function called from there (a hook) has no call site to redirect
_MODULE_CALL_FILES = ("torch/nn/modules/module.py",)
_MAX_CALL_DEPTH = 6


def _method_name_for(owner_type: type, code: CodeType, cache: dict) -> Optional[str]:
    key = (owner_type, code)
    if key in cache:
        return cache[key]
    found = None
    for klass in owner_type.__mro__:
        for name, value in vars(klass).items():
            fn = value
            seen = 0
            while fn is not None and seen < 16:
                if getattr(fn, "__code__", None) is code:
                    found = name
                    break
                fn = getattr(fn, "__wrapped__", None)
                seen += 1
            if found:
                break
        if found:
            break
    cache[key] = found
    return found


class _Recorder(TorchFunctionMode):
    def __init__(self, module_paths: dict):
        super().__init__()
        self.nodes: list[Node] = []
        self.events: list[AddEvent] = []
        self.node_of: dict[int, int] = {}
        self.keep: list = []
        self.module_paths = module_paths
        self.module_stack: list[str] = []
        self.method_cache: dict = {}
        self.aliases: dict = {}   # storage key -> {id(tensor): tensor} of the tensors seen on that storage

    # -- graph bookkeeping
    def _node_for(self, t: torch.Tensor) -> int:
        idx = self.node_of.get(id(t))
        if idx is None:
            idx = len(self.nodes)
            kind = "param" if isinstance(t, nn.Parameter) else "leaf"
            self.nodes.append(Node(idx, kind, (), False, "", tuple(t.shape), t.is_floating_point(),
                                   static=kind == "param"))
            self.node_of[id(t)] = idx
            self.keep.append(t)
            self._register_storage(t)
        return idx

    def _register_storage(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key is not None:
            self.aliases.setdefault(key, {})[id(t)] = t

    def _written(self, t: torch.Tensor, write: int) -> None:
        """``t`` was written in place by node ``write``: every other tensor seen on its storage (a view of it,
        the tensor it views) now depends on that write too (``y.view(-1).index_add_(...)``, ``y[i] += v``)."""
        key = _storage_key(t)
        if key is None:
            return
        for other in list(self.aliases.get(key, {}).values()):
            old = self.node_of.get(id(other))
            if other is t or old is None or old == write:
                continue
            idx = len(self.nodes)
            self.nodes.append(Node(idx, "written_alias", (old, write), False, self.nodes[write].module,
                                   tuple(other.shape), other.is_floating_point(),
                                   self.nodes[old].static and self.nodes[write].static))
            self.node_of[id(other)] = idx

    def _tensors(self, obj, out: list) -> list:
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                self._tensors(o, out)
        elif isinstance(obj, dict):
            for o in obj.values():
                self._tensors(o, out)
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        in_tensors = self._tensors(args, [])
        self._tensors(kwargs, in_tensors)
        in_nodes = tuple(dict.fromkeys(self._node_for(t) for t in in_tensors))
        is_add = func in _ADD_FUNCS or func in _IADD_FUNCS
        operand_nodes = None
        if is_add:
            a = args[0] if args else kwargs.get("input")
            b = args[1] if len(args) > 1 else kwargs.get("other")
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
                operand_nodes = (self.node_of[id(a)], self.node_of[id(b)])
                operand_meta = (tuple(a.shape), tuple(b.shape), a.is_floating_point() and b.is_floating_point(),
                                a.dim())
        result = func(*args, **kwargs)
        out_tensors = self._tensors(result, [])
        if func is torch.Tensor.__setitem__ and args and isinstance(args[0], torch.Tensor):
            out_tensors = [args[0]]   # ``y[index] = value`` (also the write-back of ``y[index] += value``)
        if out_tensors:
            name = getattr(func, "__name__", type(func).__name__)
            inputs = () if name in _VALUE_FREE else in_nodes[:1] if name in _FIRST_INPUT_ONLY else in_nodes
            learned = any(self.nodes[i].static for i in inputs)
            static = bool(inputs) and all(self.nodes[i].static for i in inputs)
            in_ids = {id(t) for t in in_tensors}
            inplace = (name.endswith("_") and not name.startswith("__") or name.startswith("__i")
                       or func is torch.Tensor.__setitem__)
            for t in out_tensors:   # one node per output: the chunks of ``split`` are not each other's ancestors
                if id(t) in in_ids and not inplace and "out" not in kwargs:
                    continue  # an op that returned its input unchanged: keep the tensor's node
                new = len(self.nodes)
                self.nodes.append(Node(new, name, inputs, learned, self.module_stack[-1] if self.module_stack else "",
                                       tuple(t.shape), t.is_floating_point(), static))
                self.node_of[id(t)] = new
                self.keep.append(t)
                if id(t) in in_ids:   # written in place (add_, index_put_, out=, ``y[i] = v``)
                    self._written(t, new)
                else:
                    self._register_storage(t)
            if operand_nodes is not None:
                self._record_add(func, args, kwargs, operand_nodes, operand_meta, out_tensors)
        return result

    def _record_add(self, func, args, kwargs, operand_nodes, meta, out_tensors) -> None:
        frame: Optional[FrameType] = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.replace("\\", "/").endswith(_GLUE_FILES):
            frame = frame.f_back
        not_candidate = None
        alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
        if not isinstance(alpha, (int, float)) or alpha != 1:
            not_candidate = f"scaled addition (alpha={alpha!r})"
        if "out" in kwargs:
            not_candidate = "addition with out="
        frame_code = frame.f_code if frame is not None else None
        code = frame.f_code if frame is not None else None
        position = None
        owner = None
        method_name = None
        lineno = 0
        filename = "<unknown>"
        calls: tuple = ()
        method_code = None
        if code is not None:
            filename = code.co_filename
            lineno = frame.f_lineno
            position = _position(frame)
            if position is not None:
                lineno = position[0]
            owner, method_name = self._method_of(frame)
            if owner is None:
                owner, method_name, code, calls = self._walk_to_method(frame, code, position)
            method_code = calls[0][0] if calls else code
        checkpointed = _inside_checkpoint(frame)
        del frame
        self.events.append(AddEvent(
            index=len(self.events), result=self.node_of[id(out_tensors[0])], operands=operand_nodes,
            shapes=(meta[0], meta[1]), floating=meta[2], ndim=meta[3],
            inplace=func in _IADD_FUNCS, code=code, position=position, filename=filename, lineno=lineno,
            owner=owner, method_name=method_name,
            function_name=(frame_code.co_name if frame_code else "?"), calls=calls, method_code=method_code,
            not_candidate=not_candidate, checkpointed=checkpointed))

    def _method_of(self, frame: FrameType) -> tuple:
        """(module, method name) when ``frame`` runs a method of an nn.Module on that module, else (None, None)."""
        code = frame.f_code
        if code.co_argcount > 0 or code.co_posonlyargcount > 0:
            candidate = frame.f_locals.get(code.co_varnames[0])
            if isinstance(candidate, nn.Module):
                name = _method_name_for(type(candidate), code, self.method_cache)
                if name is not None:
                    return candidate, name
        return None, None

    def _walk_to_method(self, frame: FrameType, code: CodeType, position) -> tuple:
        """From a function that is not a module's method up to the module method that called it.

        Returns (owner, method name, code holding the addition's source, call sites outermost first);
        (None, None, code, ()) when no module method is found (a hook, or too deep)."""
        levels = [(code, position)]   # innermost last: (code whose source holds the edit, position)
        parent = frame.f_back
        for _ in range(_MAX_CALL_DEPTH):
            if parent is None or parent.f_code.co_filename.replace("\\", "/").endswith(_MODULE_CALL_FILES):
                break
            pcode = parent.f_code
            if _nested_in(levels[0][0], pcode):
                # a comprehension, lambda or inner def: its source is part of the enclosing function's
                levels[0] = (pcode, levels[0][1])
            else:
                levels.insert(0, (pcode, _position(parent)))
            owner, name = self._method_of(parent)
            if owner is not None:
                if any(p is None for _, p in levels):
                    break
                return owner, name, levels[-1][0], tuple(levels[:-1])
            parent = parent.f_back
        return None, None, code, ()


def _storage_key(t: torch.Tensor) -> Optional[tuple]:
    """(device, address) of ``t``'s storage; None for tensors without one (empty, meta, some subclasses)."""
    try:
        if t.numel() == 0:
            return None
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return (str(t.device), ptr) if ptr else None


def _inside_checkpoint(frame: Optional[FrameType]) -> bool:
    """True when the addition runs inside ``torch.utils.checkpoint`` (any variant): a recomputing wrapper
    on the call stack, or saved-tensor hooks installed by it."""
    f = frame
    while f is not None:
        if f.f_code.co_filename.replace("\\", "/").endswith("torch/utils/checkpoint.py"):
            return True
        f = f.f_back
    return False


def _position(frame: FrameType) -> Optional[tuple]:
    """(lineno, end_lineno, col, end_col) of the expression ``frame`` is running (the call, in a caller)."""
    positions = list(frame.f_code.co_positions())
    i = frame.f_lasti // 2
    if 0 <= i < len(positions) and positions[i][0] is not None:
        return positions[i]
    return None


def _nested_in(inner: CodeType, outer: CodeType, depth: int = 0) -> bool:
    """``inner`` is the code of a function defined inside ``outer``'s source (a constant of it, recursively)."""
    if depth > 8:
        return False
    for const in outer.co_consts:
        if isinstance(const, CodeType) and (const is inner or _nested_in(inner, const, depth + 1)):
            return True
    return False


def run_example(model: nn.Module, example_input: Any):
    """Call ``model`` on ``example_input`` the Lightning way: tuple -> *args, dict -> **kwargs."""
    if isinstance(example_input, tuple):
        return model(*example_input)
    if isinstance(example_input, dict):
        return model(**example_input)
    return model(example_input)


def observe(model: nn.Module, example_input: Any) -> Observation:
    """Run one forward of ``model`` under the recorder (RNG state restored): every addition of two tensors, its
    operands' dataflow and its source (which of them are merges: :func:`.classify.classify`)."""
    module_paths: dict[int, str] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        module_paths.setdefault(id(mod), name)
    rec = _Recorder(module_paths)

    calls: dict[int, int] = {}

    def pre_hook(mod, args):
        rec.module_stack.append(module_paths.get(id(mod), "?"))
        calls[id(mod)] = calls.get(id(mod), 0) + 1

    def post_hook(mod, args, output):
        if rec.module_stack:
            rec.module_stack.pop()

    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    # the forward that will be trained: with autograd when the model is in training mode (inference fast
    # paths, e.g. nn.TransformerEncoderLayer's, skip the Python code that holds the merges)
    grad = torch.enable_grad() if model.training else torch.no_grad()
    with torch.random.fork_rng(devices=devices), grad:
        h1 = register_module_forward_pre_hook(pre_hook)
        h2 = register_module_forward_hook(post_hook, always_call=True)
        try:
            with rec:
                run_example(model, example_input)
        finally:
            h1.remove()
            h2.remove()
    obs = Observation(rec.nodes, rec.events, module_paths, len(module_paths), len(rec.nodes), calls)
    rec.keep.clear()
    return obs


def observe_modes(model: nn.Module, example_input: Any) -> tuple:
    """The observations of one training-mode and one eval-mode forward of ``model`` on ``example_input``
    (:func:`observe`); whatever the forwards do to the model is undone (:class:`preserved`)."""
    with preserved(model):
        model.train()
        train = observe(model, example_input)
        model.eval()
        evaluation = observe(model, example_input)
    return train, evaluation


class preserved:
    """Context manager: whatever a forward run inside does to ``model`` — buffers (BatchNorm running stats,
    ``num_batches_tracked``), plain Python attributes of its modules (counters, caches), the training flags
    and the global RNG state — is undone on exit."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        self.training = [(m, m.training) for m in self.model.modules()]
        self.buffers = [(m, name, b, b.detach().clone()) for m in self.model.modules()
                        for name, b in m._buffers.items() if b is not None]
        self.buffer_names = [(m, set(m._buffers)) for m in self.model.modules()]
        self.attrs = []
        for m in self.model.modules():
            plain = {}
            for k, v in vars(m).items():
                if k.startswith("_") and k in _MODULE_INTERNALS:
                    continue
                plain[k] = (v, copy.copy(v) if isinstance(v, (list, dict, set)) else None)
            self.attrs.append((m, plain))
        self.rng = torch.random.get_rng_state()
        cuda_live = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.cuda_rng = torch.cuda.get_rng_state_all() if cuda_live else None
        return self

    def __exit__(self, *exc):
        for m, names in self.buffer_names:
            for name in list(m._buffers):
                if name not in names:
                    del m._buffers[name]
        with torch.no_grad():
            for m, name, b, saved in self.buffers:
                if m._buffers.get(name) is not b:
                    m._buffers[name] = b
                if b.shape == saved.shape:
                    b.copy_(saved)
                else:
                    m._buffers[name] = saved
        for m, plain in self.attrs:
            d = vars(m)
            for k in [k for k in d if k not in plain and not (k.startswith("_") and k in _MODULE_INTERNALS)]:
                del d[k]
            for k, (v, shallow) in plain.items():
                d[k] = v
                if shallow is not None:
                    v.clear()
                    v.update(shallow) if not isinstance(v, list) else v.extend(shallow)
        for m, flag in self.training:
            m.training = flag
        torch.random.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        return False


_MODULE_INTERNALS = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_backward_pre_hooks",
                     "_backward_hooks", "_is_full_backward_hook", "_forward_hooks", "_forward_hooks_with_kwargs",
                     "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
                     "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                     "_load_state_dict_post_hooks"}

