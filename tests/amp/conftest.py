"""amp keeps process-wide state (like Apex): every test starts and ends with amp switched off."""

import pytest
import torch


def _reset():
    from apex.amp import _amp_state
    from apex.amp.frontend import _reset_casting

    _reset_casting()
    for name in ("opt_properties", "loss_scalers"):
        if hasattr(_amp_state, name):
            delattr(_amp_state, name)


@pytest.fixture(autouse=True)
def _amp_off():
    # Tiny models: one thread is fastest and does not fight other processes for the cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    _reset()
    yield
    _reset()
    torch.set_num_threads(threads)
    assert not torch.is_autocast_enabled("cpu"), "a test left O1 casting switched on"
