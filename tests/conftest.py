"""Test configuration: where the Triton kernels run.

By default the Triton kernels run on CPU tensors under the Triton interpreter. ``APEX_TEST_DEVICE=cuda``
runs the Triton-path cases compiled on a GPU instead (see ``tests/_device.py``); they are skipped, with the
reason, where no CUDA device is visible::

    APEX_TEST_DEVICE=cuda python -m pytest tests/ops tests/optimizers tests/normalization

``APEX_TEST_DEVICE=meta`` checks without a GPU that the Triton-path cases would run on one (every launch
checked for tensors left on the CPU, none run; ``tests/_device.py``).

``TRITON_INTERPRET`` must be set before any module that defines ``@triton.jit`` kernels is imported.
"""

import os

from tests import _device

DEVICE = _device.requested()
if DEVICE != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels, never the interpreter
os.environ.setdefault("OMP_NUM_THREADS", "2")

import contextlib  # noqa: E402
import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON and DEVICE != "cuda":
    from apex.testing import prepare_interpreter  # noqa: E402

    prepare_interpreter()
    # Every kernel module now, while TRITON_INTERPRET=1: ``triton.jit`` picks interpreted or compiled when a
    # module is first imported, and a test that sets TRITON_INTERPRET=0 for a while (the sweep and benchmark
    # runners do, for a GPU) would otherwise leave compiled kernels behind for the tests after it in the worker.
    import pkgutil  # noqa: E402

    import apex._kernels  # noqa: E402

    for _info in pkgutil.iter_modules(apex._kernels.__path__):
        importlib.import_module(f"apex._kernels.{_info.name}")
    if DEVICE == "meta":  # launches are checked, not run (tests/_device.py, MetaCheck)
        import apex.testing  # noqa: E402

        _device.CHECK.install()
        apex.testing.TritonTrace = _device.MetaLaunchCounter
elif HAS_TRITON:
    # Test modules import TritonTrace after this file runs: they get the compiled-kernel launch counter.
    import apex.testing  # noqa: E402

    apex.testing.TritonTrace = _device.LaunchCounter
    _device.cap_autotuning()

BACKENDS = ["torch", "triton"] if HAS_TRITON else ["torch"]


def _untracked_files() -> set[str] | None:
    """Untracked, not ignored files under the repository root, or None outside a git checkout."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=root,
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {line[3:] for line in out.splitlines() if line.startswith("?? ")}


def pytest_sessionstart(session):
    # Only the controlling process (not an xdist worker) watches the tree.
    if not hasattr(session.config, "workerinput"):
        session.config._apex_untracked = _untracked_files()


def pytest_sessionfinish(session, exitstatus):
    """A test run must not leave files in the repository: tests write under ``tmp_path``, and the library
    writes only where its caller says."""
    before = getattr(session.config, "_apex_untracked", None)
    if before is None:
        return
    new = sorted((_untracked_files() or set()) - before)
    if new:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write("\n")
            reporter.write_line(f"FAILED: the test run left new files in the repository: {new}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_report_header(config):
    where, why = _device.triton_device()
    if DEVICE == "cpu":
        return "apex Triton-path tests: CPU tensors under the Triton interpreter (APEX_TEST_DEVICE=cuda for a GPU)"
    if DEVICE == "meta":
        return "apex Triton-path tests: meta tensors, every Triton launch checked for the device switch, none run"
    if where is None:
        return f"apex Triton-path tests: skipped ({why})"
    return f"apex Triton-path tests: compiled on {torch.cuda.get_device_name(where)} ({where})"


@contextlib.contextmanager
def _triton_case():
    """The place a Triton-path case runs: a skip without a GPU under the switch, else the device."""
    where, why = _device.triton_device()
    if where is None:
        pytest.skip(why)
    if where.type == "cpu":
        yield where
        return
    _device.CHECK.in_case += 1
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_device.OnDevice(where))
            if where.type == "meta":
                stack.enter_context(_device.RealOpsOnMeta())
                stack.enter_context(_device.autocast_as_cuda())
            yield where
    finally:
        _device.CHECK.in_case -= 1


if DEVICE == "meta":

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(item):
        _device.CHECK.launches = 0
        try:
            return (yield)
        except BaseException as exc:
            _device.CHECK.outcome(exc)


if DEVICE == "cpu" and HAS_TRITON:

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(item):
        """A test taking ``triton_device`` must launch a Triton kernel (interpreted here): the fixture selects no
        backend, so a public entry called without ``apex.backend("triton")`` runs PyTorch's path on CPU tensors
        and the test, passing, checks nothing of the Triton path. Tests that launch none by design (a refusal
        before any launch, a recording stand-in for the kernel) say so with ``@pytest.mark.no_triton_launch``."""
        if "triton_device" not in getattr(item, "fixturenames", ()) or item.get_closest_marker("no_triton_launch"):
            return (yield)
        with _device.count_interpreted_launches() as launches:
            result = yield
        if not launches:
            pytest.fail("took the triton_device fixture but launched no Triton kernel: select the Triton path "
                        "(apex.backend('triton')), or mark the test no_triton_launch(reason)", pytrace=False)
        return result


@pytest.fixture(params=BACKENDS)
def backend_name(request):
    """Run a test once on the PyTorch path (CPU tensors) and once on the Triton path (interpreted on CPU
    tensors, or compiled on a GPU under ``APEX_TEST_DEVICE=cuda``)."""
    import apex

    if request.param == "torch":
        with apex.backend("torch"):
            yield request.param
        return
    with _triton_case(), apex.backend("triton"):
        yield request.param


@pytest.fixture
def device(request):
    """The device of the current case: the GPU for a Triton-path case under ``APEX_TEST_DEVICE=cuda``, the
    CPU otherwise. For tensors a test creates with an explicit ``device=``."""
    if "backend_name" in request.fixturenames and request.getfixturevalue("backend_name") == "triton":
        return _device.triton_device()[0]
    return torch.device("cpu")


@pytest.fixture
def triton_device():
    """For tests that run the Triton path themselves (``with apex.backend("triton")``): skips without a GPU
    under the switch, and creates the test's tensors on the device that the kernels run on."""
    with _triton_case() as where:
        yield where


@pytest.fixture
def dist_device():
    """The device the ranks of a distributed test compute on (``run_distributed(..., device=dist_device)``):
    the CPU, or under ``APEX_TEST_DEVICE=cuda`` the GPU that all the Gloo ranks share (skipped, with the
    reason, where none is visible). Tests taking it carry the ``dist_device`` marker, so
    ``APEX_TEST_DEVICE=cuda python -m pytest tests -m dist_device`` runs exactly them on the GPU."""
    if DEVICE != "cuda":  # meta: Gloo carries no meta tensors; the ranks stay on the CPU
        return torch.device("cpu")
    where, why = _device.triton_device()
    if where is None:
        pytest.skip(why)
    return where


def pytest_configure(config):
    config.addinivalue_line("markers", "dist_device: a distributed test whose ranks compute on the device of "
                                       "APEX_TEST_DEVICE (it takes the dist_device fixture)")
    config.addinivalue_line("markers", "triton_path: a test that runs the Triton path itself (it takes the "
                                       "triton_device fixture); -k triton selects it by this name")
    config.addinivalue_line("markers", "no_triton_launch(reason): a test taking triton_device that launches no "
                                       "Triton kernel by design (on the CPU every other one must launch one)")


@pytest.hookimpl(tryfirst=True)  # before -m and -k select on the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "dist_device" in names:
            item.add_marker("dist_device")
        # A test taking triton_device runs Triton kernels wherever APEX_TEST_DEVICE says, whatever its name:
        # the marker's name makes `-k triton` (the GPU check's selection) take it too.
        if "triton_device" in names:
            item.add_marker("triton_path")


# torch's settings modules: their options live outside the module's __dict__, so pytest >= 9.2's monkeypatch
# undoes a setattr on one with a delattr, which deletes the option for every later test (use the module's own
# patch(), or torch.backends' flags() context managers).
_SETTINGS_MODULES = ("torch._inductor.config", "torch._dynamo.config", "torch._functorch.config")


def _deleted_settings() -> dict:
    """How many of each loaded settings module's options are deleted (a deleted option stays in ``_config``,
    hidden: reading it raises AttributeError; none is, as torch ships them), and whether torch.backends' TF32
    flags are still there."""
    import sys

    found = {name: sum(entry.hide for entry in sys.modules[name]._config.values())
             for name in _SETTINGS_MODULES if name in sys.modules}
    for flags in (torch.backends.cuda.matmul, torch.backends.cudnn):
        found[type(flags).__name__] = int(not hasattr(flags, "allow_tf32"))
    return found


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    before = _deleted_settings()
    yield
    lost = [name for name, n in _deleted_settings().items() if n > before.get(name, 0)]
    if lost:
        pytest.fail(f"the test deleted settings of {lost}: undo a patch of torch's settings with their own "
                    "patch()/flags(), not monkeypatch.setattr", pytrace=False)
