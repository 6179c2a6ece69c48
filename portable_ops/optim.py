"""``torch.optim.Optimizer`` subclasses whose step is one fused multi-tensor call per device.

Constructor arguments, defaults and ``state_dict`` layout are torch's
(``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``; SGD's ``momentum_buffer``), so checkpoints move
between ``torch.optim.Adam/AdamW/SGD`` and these classes in both directions.
``max_grad_norm`` fuses global-norm clipping into the step: the grads are read
once for the norm and once for the step, which writes them back clipped, as torch's
``clip_grad_norm_`` leaves them. ``state_dtype=torch.float32``
keeps the moments of float16/bfloat16 params in float32.
"""

from __future__ import annotations

import contextlib
import math
import operator
import re
from itertools import repeat

import numpy as np
import torch

from . import checks, sgd_checks
from .clip import checked_total_norm, clip_coefficient
from .distributed import global_norm, is_dtensor, local
from .functional import adam_call, check_written_grads, sgd_call, skipped_before_buffers_exist
from .dispatch import dispatch

_grad = operator.attrgetter("grad")


class _FusedOptimizer(torch.optim.Optimizer):
    """What the fused optimizers share: GradScaler's protocol, ``max_grad_norm`` (one global norm, fused into
    the step as a clip coefficient), refusing a param listed twice, and the per-group lists cache."""

    def __init__(self, params, defaults):
        super().__init__(params, defaults)
        self._step_supports_amp_scaling = True  # GradScaler hands us grad_scale / found_inf
        self.last_grad_norm: torch.Tensor | None = None
        self._lists_cache: dict[int, tuple] = {}
        self._pending_cache: dict[int, tuple] = {}

    def __setstate__(self, state):
        super().__setstate__(state)
        self._lists_cache, self._pending_cache = {}, {}  # load_state_dict comes through here

    def _check_group(self, group) -> None:
        """A new param group's options, checked as the constructor checks them."""

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_group(group)
            self._max_grad_norm()
            if len(set(map(id, group["params"]))) != len(group["params"]):
                # torch warns and steps such a param twice in turn; one fused launch can't
                raise ValueError(f"param_groups[{len(self.param_groups) - 1}] holds a parameter twice: each "
                                 f"parameter may be stepped once per step; list it once")
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    def _cached_lists(self, group, flags, with_grad):
        """The per-device lists of ``group`` cached by an earlier step, or None where they no longer hold.

        Rebuilding these lists is most of a step's host time (hundreds of tensors), so they are kept while
        the same params have grads, with the shapes, dtypes and devices their state was checked against, and
        their state dicts are the same objects. A param whose ``.data`` was replaced (resized, cast by
        ``model.half()``, moved) rebuilds them, and so does a state tensor assigned by hand (each optimizer
        checks its own: :meth:`Adam._state_unchanged`, :meth:`SGD._buffers_unchanged`).
        """
        cached = self._lists_cache.get(id(group))
        if (cached is not None and cached[0] == flags and len(cached[1]) == len(with_grad)
                and all(map(operator.is_, cached[1], with_grad))
                and all(map(operator.is_, map(self.state.get, with_grad), cached[2]))
                and all(map(_params_unchanged, cached[3].values()))):
            return cached[3]
        return None

    def _pend_lists(self, group, flags, with_grad, by_device) -> None:
        """Lists built this step, cached by :meth:`_commit_lists` once the step's new state is in place."""
        for lists in by_device.values():
            lists["sharded"] = any(map(is_dtensor, lists["keys"]))
            lists["layouts"] = checks.layouts(lists["params"])
        self._pending_cache[id(group)] = (flags, with_grad, by_device)

    def _refresh_lists(self, lists) -> None:
        """Point a pending entry's state lists at the state as committed (the step's new tensors)."""

    def _commit_lists(self) -> None:
        for key, (flags, with_grad, by_device) in self._pending_cache.items():
            states = [self.state.get(p) for p in with_grad]  # the dicts as committed
            for lists in by_device.values():
                self._refresh_lists(lists)
            self._lists_cache[key] = (flags, with_grad, states, by_device)
        self._pending_cache = {}

    def _kernels(self, op, calls, max_grad_norm, grad_scale) -> list:
        """The backend kernel of ``op`` for each ``(params, call)``, chosen before anything is written (strict mode
        may refuse one), with the global clip's coefficient set in every call first when ``max_grad_norm`` is finite
        (a backend may decline a call that writes its grads; the norm is measured when it is not None)."""
        norm = coef = None
        if max_grad_norm is not None and calls:
            norm = self._grad_norm([p.grad for keys, _ in calls for p in keys], grad_scale)
            # an infinite max_grad_norm measures, never clips: its coefficient inf / inf of an overflowed norm is NaN
            coef = None if max_grad_norm == math.inf else clip_coefficient(norm, max_grad_norm)
        if coef is not None or (grad_scale is not None and len(calls) > 1):
            # the step writes the grads: checked across the calls, as each call checked its own
            self._check_grads_written(calls)
        for _, call in calls if coef is not None else ():
            call["clip_coef"] = coef.to(call["params"][0].device)
        kernels = [dispatch(op, call, call["params"][0].device) for _, call in calls]
        if norm is not None:
            self.last_grad_norm = norm
        return kernels

    def _check_grads_written(self, calls) -> None:
        """The step's grads, which it writes, checked together (:func:`check_written_grads`), named as the user
        sees them."""
        keys = [p for keys, _ in calls for p in keys]

        def name(i):
            where = {id(p): (g, j) for g, group in enumerate(self.param_groups) for j, p in enumerate(group["params"])}
            return _AS_THE_USER_SEES["grads"].format(p='param_groups[{}]["params"][{}]'.format(*where[id(keys[i])]))
        check_written_grads([g for _, call in calls for g in call["grads"]], name)

    def _max_grad_norm(self) -> float | None:
        """Every group's ``max_grad_norm``, checked: one value (the clip is one global norm), or None."""
        values = [group["max_grad_norm"] for group in self.param_groups]
        for value in values:
            _check_max_grad_norm(value)
        values = [checks.as_number(value) for value in values]
        for i, value in enumerate(values):
            if value != values[0]:
                raise ValueError(f"max_grad_norm must be the same in every param group (the clip is one global "
                                 f"norm): param_groups[{i}] has {value}, param_groups[0] has {values[0]}")
        return values[0] if values else None

    def _grad_norm(self, grads, grad_scale):
        norm = global_norm(grads, 2.0, checked_total_norm)
        if grad_scale is not None:
            # 0-d as the calls hold it: a [1] scale (older GradScalers') would make the coefficient [1]
            norm = norm / grad_scale.to(norm.device).reshape(())
        return norm


class Adam(_FusedOptimizer):
    """Adam with L2 weight decay (``torch.optim.Adam``), plus ``max_grad_norm``.

    ``foreach``, ``fused`` and ``capturable`` are accepted so that code written
    for torch runs unchanged; they change nothing here: every step is the fused
    multi-tensor path, with ``step`` kept on the parameter's device so a step
    never synchronises and can be captured in a CUDA graph.

    ``state_dtype``: None keeps ``exp_avg``, ``exp_avg_sq`` and ``max_exp_avg_sq`` in the
    param's dtype, as torch does; ``torch.float32`` keeps them in float32 for float16/bfloat16
    params (float32 and float64 params keep their own dtype), so the moments do not lose the
    small updates a 16-bit format rounds away. It is a per-group option; the state follows it when
    created, when loaded (``load_state_dict``) and on the next step after it is changed.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 maximize=False, max_grad_norm=None, state_dtype=None, foreach=None, fused=None,
                 capturable=False, differentiable=False, decoupled_weight_decay=False):
        if differentiable:
            raise ValueError("differentiable=True is not supported: the fused step is not differentiable")
        if not isinstance(betas, (tuple, list, np.ndarray)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair of floats, got {betas!r}")
        checks.check_adam_hyperparameters(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
        _check_max_grad_norm(max_grad_norm)
        checks.check_state_dtype(state_dtype)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, max_grad_norm=max_grad_norm, state_dtype=state_dtype,
                        decoupled_weight_decay=bool(decoupled_weight_decay))
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:  # checkpoints from torch.optim lack our keys
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("max_grad_norm", self.defaults.get("max_grad_norm"))
            group.setdefault("state_dtype", self.defaults.get("state_dtype"))
            group.setdefault("decoupled_weight_decay", False)  # torch's Adam's default for its older checkpoints
            for p in group["params"]:  # checkpoints older than torch 1.12 count steps in Python numbers
                p_state = self.state.get(p, {})
                if "step" in p_state and not isinstance(p_state["step"], torch.Tensor):
                    p_state["step"] = torch.tensor(float(p_state["step"]), dtype=torch.float32, device=p.device)

    def _check_group(self, group):
        checks.check_state_dtype(group["state_dtype"])

    def load_state_dict(self, state_dict):
        """torch's, except that each group keeps this optimizer's ``state_dtype`` and the moments take it.

        torch casts floating-point state to the param's dtype, which would round a float32 checkpoint's
        moments to bfloat16 on the way in; for groups with float32 state they are read again from the
        checkpoint's own tensors, so float32 state loads exactly and torch's bfloat16 state is upcast
        (exactly). A float32-state checkpoint loaded with ``state_dtype=None`` is rounded to the
        param's dtype, as ``torch.optim`` would.
        """
        state_dtypes = [g["state_dtype"] for g in self.param_groups]
        super().load_state_dict(state_dict)
        for saved_group, group, state_dtype in zip(state_dict["param_groups"], self.param_groups, state_dtypes):
            group["state_dtype"] = state_dtype
            for saved_id, p in zip(saved_group["params"], group["params"]):
                saved, state = state_dict["state"].get(saved_id), self.state.get(p)
                if saved is None or state is None:
                    continue
                dtype = checks.state_dtype_for(p.dtype, state_dtype)
                for key in _MOMENTS:
                    if key in state and state[key].dtype != dtype:
                        state[key] = saved[key].to(p.device, dtype)

    def _state_lists(self, group):
        """Per device, the params with grads and their state as lists, and the state to create; cached
        (:meth:`_cached_lists`). A param whose ``.data`` was replaced has its moments cast to its new dtype,
        and a size or device its state does not have is refused by the checks."""
        with_grad = [p for p in group["params"] if p.grad is not None]
        flags = (group["amsgrad"], group["state_dtype"])
        cached = self._cached_lists(group, flags, with_grad)
        if cached is not None and self._state_unchanged(cached, group["amsgrad"]):
            return cached, {}, True
        checks.check_state_dtype(group["state_dtype"])
        by_device: dict[torch.device, dict[str, list]] = {}
        new_state = {}
        for p in with_grad:
            dtype = checks.state_dtype_for(p.dtype, group["state_dtype"])
            state = self.state.get(p) or new_state.setdefault(p, _fresh_state(p, group["amsgrad"], dtype))
            conformed = _conformed_state(state, p, group["amsgrad"], dtype)
            if conformed is not state:
                state = new_state[p] = conformed
            lists = by_device.get(p.device)
            if lists is None:
                lists = by_device[p.device] = {k: [] for k in ("keys", "params", "exp_avgs", "exp_avg_sqs", "max",
                                                               "steps")}
            lists["keys"].append(p)
            lists["params"].append(local(p))
            lists["exp_avgs"].append(local(state["exp_avg"]))
            lists["exp_avg_sqs"].append(local(state["exp_avg_sq"]))
            lists["max"].append(local(state["max_exp_avg_sq"]) if group["amsgrad"] else None)
            lists["steps"].append(state["step"])
        self._pend_lists(group, flags, with_grad, by_device)
        return by_device, new_state, False

    def _calls(self, grad_scale, found_inf):
        """(params, checked functional call, whether its lists are the cached ones) for every (group, device), and
        the state to create for new params.

        DTensor parameters (FSDP2) contribute their local shards: the step is elementwise.
        """
        calls, new_state = [], {}
        self._pending_cache = {}
        for g, group in enumerate(self.param_groups):
            by_device, created, checked = self._state_lists(group)
            new_state.update(created)
            beta1, beta2 = group["betas"]
            for device, lists in by_device.items():
                grads = list(map(_grad, lists["keys"]))  # C-level: hundreds of tensors per step
                if lists["sharded"]:
                    grads = list(map(local, grads))
                plain = checked and grad_scale is None and found_inf is None
                call = _steady_call(lists, group, grads) if plain else None
                if call is None:
                    with _named_as_the_user_sees_them(g, group, lists["keys"]):
                        call = adam_call(
                            lists["params"], grads, lists["exp_avgs"], lists["exp_avg_sqs"],
                            lists["max"] if group["amsgrad"] else [], lists["steps"], amsgrad=group["amsgrad"],
                            beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                            eps=group["eps"], maximize=group["maximize"],
                            decoupled_weight_decay=group["decoupled_weight_decay"], grad_scale=_on(grad_scale, device),
                            found_inf=_on(found_inf, device), state_dtype=group["state_dtype"],
                            checked_layouts=lists["layouts"] if checked else None)
                    if plain:
                        _keep_steady_call(lists, group, call)
                calls.append((lists["keys"], call, checked))
        return calls, new_state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        # Everything that can raise (argument checks, the backend choices, which strict mode may
        # refuse, and the clip's norm) runs before the first write: a refused step leaves the params
        # and the optimizer state exactly as they were.
        max_grad_norm = self._max_grad_norm()
        calls, new_state = self._calls(grad_scale, found_inf)
        moved_steps = []  # torch keeps `step` on the CPU unless fused; ours lives with its param
        for keys, call, cached in calls:
            if cached:  # their steps were moved when the lists were cached
                continue
            steps = call["state_steps"]  # the call's own list (adam_call copies it)
            for i, p in enumerate(keys):
                if steps[i].device != call["params"][i].device:
                    steps[i] = steps[i].to(call["params"][i].device, torch.float32)
                    moved_steps.append((p, steps[i]))
        kernels = self._kernels("adam", [(keys, call) for keys, call, _ in calls], max_grad_norm, grad_scale)
        previous = {p: (self.state.get(p), self.state[p]["step"] if p in self.state else None)
                    for p in (*new_state, *(p for p, _ in moved_steps))}
        self.state.update(new_state)
        for p, step in moved_steps:
            self.state[p]["step"] = step
        if moved_steps:
            self._lists_cache.clear()  # their step lists hold the old tensors; rebuilt at the next step
        self._commit_lists()
        ran = 0
        try:
            for kernel, (_, call, _) in zip(kernels, calls):
                kernel.run(**call)
                ran += 1
        except BaseException:
            # a launch that failed (out of memory, say) and those after it wrote nothing: their params' state goes
            # back to what it was, so the state matches the params (torch keeps no entry for a param never stepped)
            for keys, _, _ in calls[ran:]:
                for p in keys:
                    if p in previous:
                        state, step = previous[p]
                        if state is None:
                            del self.state[p]
                        else:
                            self.state[p] = state
                            state["step"] = step
            self._lists_cache.clear()
            raise
        return loss

    def _refresh_lists(self, lists):
        lists["states"] = [self.state[p] for p in lists["keys"]]
        lists["steps"] = [state["step"] for state in lists["states"]]
        lists["state_spans"] = _state_spans(lists, _ADAM_STATE)

    def _state_unchanged(self, by_device, amsgrad) -> bool:
        """Whether each cached param's step and moments are still the tensors its lists hold: one assigned since
        (a moment reset by hand, which torch's Adam honours) rebuilds the lists. C-level passes over the state
        dicts as committed, which :meth:`_cached_lists` found to be the params' still."""
        names = (("exp_avg", "exp_avgs"), ("exp_avg_sq", "exp_avg_sqs")) + ((("max_exp_avg_sq", "max"),) if amsgrad
                                                                            else ())
        for lists in by_device.values():
            states = lists["states"]
            if not all(map(operator.is_, map(dict.get, states, repeat("step")), lists["steps"])):
                return False
            for key, name in names:
                tensors = map(dict.get, states, repeat(key))
                if lists["sharded"]:
                    tensors = map(local, tensors)
                if not all(map(operator.is_, tensors, lists[name])):
                    return False
            # the same tensors, resized or given other data since (.data, resize_): the kernels would write past them
            if _state_spans(lists, _ADAM_STATE) != lists["state_spans"]:
                return False
        return True


class AdamW(Adam):
    """AdamW: decoupled weight decay (``torch.optim.AdamW``), plus ``max_grad_norm``."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, max_grad_norm=None, state_dtype=None, foreach=None, fused=None,
                 capturable=False, differentiable=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         max_grad_norm=max_grad_norm, state_dtype=state_dtype, foreach=foreach, fused=fused,
                         capturable=capturable, differentiable=differentiable, decoupled_weight_decay=True)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:  # as torch's AdamW: decoupled, whatever a loaded checkpoint says
            group["decoupled_weight_decay"] = True


class SGD(_FusedOptimizer):
    """SGD with momentum, dampening, Nesterov, L2 weight decay and maximize (``torch.optim.SGD``), plus
    ``max_grad_norm``.

    torch's state: ``momentum_buffer`` in the param's dtype, made from the grad on a param's first step
    under momentum (none without momentum), so checkpoints move both ways. ``foreach`` and ``fused`` are
    accepted so that code written for torch runs unchanged; they change nothing here: every step is the
    fused multi-tensor path. A GradScaler step that would make momentum buffers and finds an inf is not
    taken (the buffers stay unmade, as torch's SGD leaves them): deciding that reads ``found_inf`` on the
    host, on such a step only.
    """

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None, max_grad_norm=None):
        if differentiable:
            raise ValueError("differentiable=True is not supported: the fused step is not differentiable")
        if fused and foreach:  # torch's refusal, in its words
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
        sgd_checks.check_sgd_hyperparameters(lr=lr, momentum=momentum, dampening=dampening,
                                             weight_decay=weight_decay, nesterov=nesterov)
        _check_max_grad_norm(max_grad_norm)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach, differentiable=differentiable,
                        fused=fused, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:  # checkpoints from torch.optim lack our keys (older ones, some of torch's)
            for key, default in (("nesterov", False), ("maximize", False), ("foreach", None),
                                 ("differentiable", False), ("fused", None)):
                group.setdefault(key, default)
            group.setdefault("max_grad_norm", self.defaults.get("max_grad_norm"))

    def _check_group(self, group):
        sgd_checks.check_sgd_hyperparameters(lr=group["lr"], momentum=group["momentum"],
                                             dampening=group["dampening"], weight_decay=group["weight_decay"],
                                             nesterov=group["nesterov"])

    def _state_lists(self, group):
        """Per device, the params with grads and their momentum buffers (None where not made yet); cached
        (:meth:`_cached_lists`)."""
        with_grad = [p for p in group["params"] if p.grad is not None]
        flags = (checks.as_number(group["momentum"]) != 0,)
        cached = self._cached_lists(group, flags, with_grad)
        if cached is not None and (not flags[0] or self._buffers_unchanged(cached)):
            return cached, True
        by_device: dict[torch.device, dict[str, list]] = {}
        for p in with_grad:
            lists = by_device.get(p.device)
            if lists is None:
                lists = by_device[p.device] = {"keys": [], "params": [], "buffers": []}
            lists["keys"].append(p)
            lists["params"].append(local(p))
            if flags[0]:
                buffer = self.state.get(p, {}).get("momentum_buffer")
                lists["buffers"].append(None if buffer is None else local(buffer))
        self._pend_lists(group, flags, with_grad, by_device)
        return by_device, False

    def _buffers_unchanged(self, by_device) -> bool:
        """Whether each cached param's ``state[p]["momentum_buffer"]`` is still the buffer its lists hold: one
        assigned or deleted since (momentum reset by hand, as torch's SGD honours) rebuilds the lists. C-level
        passes over the state dicts as committed, which :meth:`_cached_lists` found to be the params' still."""
        for lists in by_device.values():
            buffers = map(dict.get, lists["states"], repeat("momentum_buffer"))
            if lists["sharded"]:
                buffers = map(local, buffers)
            if not all(map(operator.is_, buffers, lists["buffers"])):
                return False
            if _state_spans(lists, ("buffers",)) != lists["state_spans"]:  # resized or given other data
                return False
        return True

    def _refresh_lists(self, lists):
        if lists["buffers"]:
            lists["states"] = [self.state[p] for p in lists["keys"]]
            lists["buffers"] = [local(state["momentum_buffer"]) for state in lists["states"]]
        lists["state_spans"] = _state_spans(lists, ("buffers",))

    def _calls(self, grad_scale, found_inf):
        """(params, checked functional call) for every (group, device)."""
        calls = []
        self._pending_cache = {}
        for g, group in enumerate(self.param_groups):
            by_device, checked = self._state_lists(group)
            for device, lists in by_device.items():
                grads = list(map(_grad, lists["keys"]))
                if lists["sharded"]:
                    grads = list(map(local, grads))
                with _named_as_the_user_sees_them(g, group, lists["keys"]):
                    call = sgd_call(lists["params"], grads, lists["buffers"], lr=group["lr"],
                                    momentum=group["momentum"], dampening=group["dampening"],
                                    weight_decay=group["weight_decay"], nesterov=group["nesterov"],
                                    maximize=group["maximize"], grad_scale=_on(grad_scale, device),
                                    found_inf=_on(found_inf, device),
                                    checked_layouts=lists["layouts"] if checked else None)
                calls.append((lists["keys"], call))
        return calls

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        # Everything that can raise runs before the first write: a refused step leaves the params and the
        # optimizer state exactly as they were.
        max_grad_norm = self._max_grad_norm()
        calls = self._calls(grad_scale, found_inf)
        kernels = self._kernels("sgd", calls, max_grad_norm, grad_scale)
        if any(map(skipped_before_buffers_exist, (call for _, call in calls))):
            self._pending_cache = {}
            return loss
        for keys, call in calls:
            for p, first, buffer in zip(keys, call["first_steps"], call["momentum_buffers"]):
                if first:
                    self.state[p]["momentum_buffer"] = _state_like(buffer, p)
        self._commit_lists()
        ran = 0
        try:
            for kernel, (_, call) in zip(kernels, calls):
                kernel.run(**call)
                ran += 1
        except BaseException:
            # a launch that failed (out of memory, say) and those after it made no buffer: unmake them, so the
            # next step makes them from its grad instead of reading uninitialised memory
            for keys, call in calls[ran:]:
                for p, first in zip(keys, call["first_steps"]):
                    if first:
                        del self.state[p]["momentum_buffer"]
                        if not self.state[p]:  # no entry at all, as torch keeps none for a param never stepped
                            del self.state[p]
            self._lists_cache.clear()
            raise
        return loss


_ADAM_STATE = ("exp_avgs", "exp_avg_sqs", "max", "steps")
_data_ptr = torch.Tensor.data_ptr


def _state_spans(lists, names) -> list:
    """Where the state tensors ``lists`` holds under ``names`` (None entries: no such state) start and how many
    elements they hold, as the step's checks saw them when the lists were made: a tensor resized or given other
    data since (``resize_``, ``.data = ...``) changes one. C-level passes, every step."""
    return [(list(map(_data_ptr, ts)), list(map(torch.Tensor.numel, ts)))
            for ts in map(lists.__getitem__, names) if ts and ts[0] is not None]


_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "state_dtype",
                    "decoupled_weight_decay")
_PLAIN = (float, int, bool, type(None), torch.dtype)


def _hyperparameters(group) -> tuple | None:
    """``group``'s step options, or None where one is not a plain Python value (a tensor lr is read each step)."""
    values = tuple(map(group.__getitem__, _HYPERPARAMETERS))
    betas = values[1]
    if betas.__class__ is not tuple or not all(v.__class__ in _PLAIN for v in (*betas, *values[:1], *values[2:])):
        return None
    return values


def _keep_steady_call(lists, group, call) -> None:
    """Keep a checked call of cached lists (no grad scale, no found_inf) for the steps after it: the checks of
    its state and options hold while the lists do and the options are equal (:func:`_steady_call`)."""
    real = not any(dtype.is_complex for dtype in map(operator.attrgetter("dtype"), lists["params"]))
    options = _hyperparameters(group)
    # a copy: the step sets this one's clip_coef, which a later step without a clip must not inherit
    lists["steady"] = (options, {**call}) if real and options is not None else None


def _steady_call(lists, group, grads):
    """The call kept by :func:`_keep_steady_call` with this step's ``grads``, where its options are still the
    group's and the grads are laid out as its params (the only check a step of unchanged lists and options
    needs); else None, and the step is checked whole."""
    steady = lists.get("steady")
    if steady is None or steady[0] != _hyperparameters(group) or checks.layouts(grads) != lists["layouts"]:
        return None
    return {**steady[1], "grads": grads}


def _state_like(buffer, p):
    """A new momentum buffer (the call's tensor) as the optimizer's state holds it: complex for a complex param,
    a DTensor sharded as its param for a DTensor param."""
    if p.is_complex():
        buffer = torch.view_as_complex(buffer)
    if is_dtensor(p):
        buffer = type(p).from_local(buffer, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                    stride=p.stride())
    return buffer


def _check_max_grad_norm(value):
    """None (no clip), or a number > 0; ``inf`` measures the norm (``last_grad_norm``) without clipping."""
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        raise TypeError("max_grad_norm must be None or a number, got a tensor")
    checks.check_number("max_grad_norm", value, low=0.0, finite=False)
    if checks.as_number(value) <= 0:
        raise ValueError(f"max_grad_norm must be > 0 or None, got {value}")


_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _fresh_state(p, amsgrad, dtype):
    state = {"step": torch.zeros((), dtype=torch.float32, device=p.device)}
    for key in _MOMENTS[:3 if amsgrad else 2]:
        state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
    return state


def _conformed_state(state, p, amsgrad, dtype):
    """``state`` with ``max_exp_avg_sq`` added if amsgrad was switched on and the moments cast if
    ``state_dtype`` was changed since they were made; ``state`` itself when neither happened."""
    changed = {key: state[key].to(dtype) for key in _MOMENTS if key in state and state[key].dtype != dtype}
    if amsgrad and "max_exp_avg_sq" not in state:
        changed["max_exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
    return {**state, **changed} if changed else state


def _params_unchanged(lists) -> bool:
    """The cached params are still the tensors, with the layouts, that their state lists were checked against."""
    if lists["sharded"] and not all(map(operator.is_, map(local, lists["keys"]), lists["params"])):
        return False
    return checks.layouts(lists["params"]) == lists["layouts"]


# The functional call's list entries, as a user of the optimizer names the same tensors
_LIST_ENTRY = re.compile(r"\b(params|grads|exp_avgs|exp_avg_sqs|max_exp_avg_sqs|state_steps|momentum_buffer_list)"
                         r"\[(\d+)\]")
_AS_THE_USER_SEES = {"params": "{p}", "grads": "{p}.grad", "exp_avgs": 'state[{p}]["exp_avg"]',
                     "exp_avg_sqs": 'state[{p}]["exp_avg_sq"]', "max_exp_avg_sqs": 'state[{p}]["max_exp_avg_sq"]',
                     "state_steps": 'state[{p}]["step"]', "momentum_buffer_list": 'state[{p}]["momentum_buffer"]'}


@contextlib.contextmanager
def _named_as_the_user_sees_them(g: int, group: dict, keys: list):
    """A refusal of the functional call names ``params[i]`` of its per-device lists; re-raised, it names
    ``param_groups[g]["params"][j]`` (and that param's grad or state), the tensor the user handed over."""
    try:
        yield
    except (TypeError, ValueError) as exc:
        where = {id(p): j for j, p in enumerate(group["params"])}

        def named(match):
            p = f'param_groups[{g}]["params"][{where[id(keys[int(match[2])])]}]'
            return _AS_THE_USER_SEES[match[1]].format(p=p)
        raise type(exc)(_LIST_ENTRY.sub(named, str(exc))) from None


def _on(t, device):
    return t.to(device) if isinstance(t, torch.Tensor) else t  # anything else: the call's checks name it
