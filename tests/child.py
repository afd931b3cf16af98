"""Python code run in a child process that sees this checkout's drvtrain first: for a GPU
test whose subject ends the CUDA context (a kernel's trap)."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, *, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``code`` (dedented) with ``python -c``; returns the finished process, output captured."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)
