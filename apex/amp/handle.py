"""``amp.scale_loss`` and the O1 casting handle.

O1 is built on ``torch.autocast``: ``amp.initialize`` switches autocast on for the model's device type
and half dtype, process-wide, the way Apex's O1 patched the torch namespace process-wide (the loss
computed after the forward pass is covered too). It stays on until the next ``initialize`` or until the
models it was set up for are garbage-collected. ``disable_casts()`` turns it off inside a block and the
optimizer's ``step`` always runs without casts. Autocast caches the half copies of the weights; the cache
is dropped when ``scale_loss`` exits, before the optimizer changes the weights, as Apex dropped its own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from apex.amp._amp_state import _amp_state, master_params  # noqa: F401  (Apex exposes it here)


@contextlib.contextmanager
def scale_loss(loss: torch.Tensor, optimizers, loss_id: int = 0, model=None, delay_unscale: bool = False,
               delay_overflow_check: bool = False) -> Iterator[torch.Tensor]:
    """Yield ``loss.float() * loss_scale``; on exit unscale the gradients and check them for infs/NaNs.

    Use::

        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()

    On exit (unless ``delay_unscale``) the gradients of every optimizer's parameters are divided by the
    loss scale (into the fp32 master gradients under O2), the overflow flag is read once, the dynamic scale
    is updated and, if any gradient was inf or NaN, the next ``optimizer.step()`` of each optimizer is
    skipped, leaving parameters and optimizer state untouched.

    The block runs with O1's casting switched off, so ``backward()`` computes each gradient in the dtype its
    forward ran in: regions that ran in fp32 under O1 (``float_function``, ``disable_casts``) get fp32
    gradients, as with Apex, whose O1 never cast inside backward.

    Args:
        loss: typically a scalar tensor.
        optimizers: the optimizer(s) returned by ``amp.initialize`` that own the parameters receiving
            gradients in this backward pass.
        loss_id: which loss scaler to use, in ``[0, num_losses)``.
        model: unused, kept for Apex compatibility.
        delay_unscale: leave the gradients scaled (gradient accumulation); a later ``scale_loss`` with
            ``delay_unscale=False`` unscales them all, and ``step()`` must wait until then.
        delay_overflow_check: do not read the overflow flag or update the scale on exit.
    """
    if not hasattr(_amp_state, "opt_properties"):
        raise RuntimeError("Invoked 'with amp.scale_loss`, but internal Amp state has not been "
                           "initialized.  model, optimizer = amp.initialize(model, optimizer, "
                           "opt_level=...) must be called before `with amp.scale_loss`.")
    if not _amp_state.opt_properties.enabled:
        yield loss
        return
    if isinstance(optimizers, torch.optim.Optimizer) or hasattr(optimizers, "_amp_stash"):
        optimizers = [optimizers]
    optimizers = list(optimizers)
    for opt in optimizers:
        if not hasattr(opt, "_amp_stash"):
            raise RuntimeError("scale_loss received an optimizer that was not returned by amp.initialize; "
                               "pass the optimizer(s) through amp.initialize first.")
    n = len(_amp_state.loss_scalers)
    if not isinstance(loss_id, int) or not 0 <= loss_id < n:
        raise ValueError(f"loss_id must be an int in [0, {n}) (num_losses={n} in amp.initialize), "
                         f"got {loss_id!r}")

    loss_scaler = _amp_state.loss_scalers[loss_id]
    loss_scale = loss_scaler.loss_scale()

    if (not _amp_state.opt_properties.master_weights and not loss_scaler.dynamic and loss_scale == 1.0):
        with _backward_casts_off():
            yield loss.float()
        if _amp_state.opt_properties.patch_torch_functions:
            _amp_state.handle._clear_cache()
        return

    if not delay_unscale:
        for optimizer in optimizers:
            if not optimizer._amp_stash.params_have_scaled_gradients:
                optimizer._prepare_amp_backward()

    scaled = loss.float() * loss_scale
    with _backward_casts_off():
        yield scaled

    if delay_unscale:
        for optimizer in optimizers:
            optimizer._amp_stash.params_have_scaled_gradients = True
    else:
        loss_scaler.clear_overflow_state()
        for optimizer in optimizers:
            optimizer._post_amp_backward(loss_scaler)
            optimizer._amp_stash.params_have_scaled_gradients = False
        should_skip = False if delay_overflow_check else loss_scaler.update_scale()
        if should_skip:
            for optimizer in optimizers:
                stash = optimizer._amp_stash
                if stash.skip_pending is None:
                    stash.skip_pending = (loss_id, loss_scaler)
                    stash.already_patched = True

    if _amp_state.opt_properties.patch_torch_functions:
        _amp_state.handle._clear_cache()


def _backward_casts_off():
    """The body of ``scale_loss`` (the user's ``backward()``) runs without O1's casting.

    Autocast is process-wide under O1 and autograd replays the thread's autocast state in backward, so
    without this the backward of a region that ran in fp32 (``float_function``, ``disable_casts``, a model
    that is not amp's) would recompute its matmuls in the half type. Apex's O1 patched only the forward
    functions and never touched backward; regions that ran in half precision still get half gradients,
    because their saved inputs are half tensors.
    """
    handle = getattr(_amp_state, "handle", None)
    if handle is None or not _amp_state.opt_properties.patch_torch_functions:
        return contextlib.nullcontext()
    return handle._disable_casts()


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Run a block without O1's automatic casting (no-op when O1 is not active)."""
    handle = getattr(_amp_state, "handle", None)
    if handle is None:
        yield
        return
    with handle._disable_casts():
        yield


class AmpHandle:
    """O1's casting state: ``torch.autocast`` switched on for ``device_type`` with ``dtype``."""

    def __init__(self, loss_scale="dynamic", enable_caching: bool = True, verbose: bool = False,
                 device_type: str = "cpu", dtype: torch.dtype = torch.bfloat16):
        self._enable_caching = enable_caching
        self._verbose = verbose
        self._is_active = False
        self._all_wrappers: list = []
        self.device_type = device_type
        self.dtype = dtype
        self._saved = None
        # disable_casts() nests per thread, as autocast's own state does.
        self._local = threading.local()

    # -- autocast on/off ------------------------------------------------------------------------
    def _activate(self) -> None:
        if self._saved is not None:
            return
        d = self.device_type
        self._saved = (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d),
                       torch.is_autocast_cache_enabled())
        torch.set_autocast_enabled(d, True)
        torch.set_autocast_dtype(d, self.dtype)
        torch.set_autocast_cache_enabled(self._enable_caching)
        torch.autocast_increment_nesting()
        self._is_active = True

    def _deactivate(self) -> None:
        """Switch the casting off and restore functions replaced by ``register_*_function``."""
        from apex.amp import amp as _amp

        for mod, name, func, own in reversed(self._all_wrappers):
            if own:
                setattr(mod, name, func)
            else:  # it was inherited (a torch.Tensor method from its C base): inherit it again
                delattr(mod, name)
        self._all_wrappers = []
        if self._saved is not None:
            enabled, dtype, cache = self._saved
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()
            torch.set_autocast_enabled(self.device_type, enabled)
            torch.set_autocast_dtype(self.device_type, dtype)
            torch.set_autocast_cache_enabled(cache)
            self._saved = None
        self._is_active = False
        if _amp._DECORATOR_HANDLE is self:
            _amp._DECORATOR_HANDLE = None

    def is_active(self) -> bool:
        """Casting is on, and not switched off by ``disable_casts()`` in the calling thread."""
        return self._is_active and not getattr(self._local, "disabled", 0)

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        local = self._local
        local.disabled = getattr(local, "disabled", 0) + 1
        try:
            if self._saved is not None:
                with torch.autocast(self.device_type, enabled=False):
                    yield
            else:
                yield
        finally:
            local.disabled -= 1

    @contextlib.contextmanager
    def scale_loss(self, loss, optimizer):
        raise RuntimeError("The old Amp API is no longer supported.  Please move to the new API, "
                           "documented here:  https://nvidia.github.io/apex/amp.html.  Transition guide:  "
                           "https://nvidia.github.io/apex/amp.html#transition-guide-for-old-api-users")
        yield  # pragma: no cover

    def wrap_optimizer(self, optimizer, num_loss: int = 1):
        raise RuntimeError("The old Amp API (handle.wrap_optimizer) is no longer supported; use "
                           "amp.initialize(model, optimizer, opt_level=...) and amp.scale_loss.")

    def _clear_cache(self) -> None:
        torch.clear_autocast_cache()

    def _save_func(self, mod, name, func) -> None:
        own = not isinstance(mod, type) or name in vars(mod)
        self._all_wrappers.append((mod, name, func, own))

    @property
    def has_cache(self) -> bool:
        return self._enable_caching

    @property
    def verbose(self) -> bool:
        return self._verbose


class NoOpHandle:
    """The handle amp returns when it is disabled (``enabled=False``): ``scale_loss`` yields the loss
    unchanged, and nothing is cast or scaled.
    """
    def is_active(self) -> bool:
        return False

    @contextlib.contextmanager
    def _disable_casts(self):
        yield

    @contextlib.contextmanager
    def scale_loss(self, loss, optimizer):
        yield loss

    @property
    def has_cache(self) -> bool:
        return False

    @property
    def verbose(self) -> bool:
        return False

    def _clear_cache(self) -> None:
        pass

    def _activate(self) -> None:
        pass

    def _deactivate(self) -> None:
        pass
