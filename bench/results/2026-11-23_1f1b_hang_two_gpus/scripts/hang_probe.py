"""main.py with a dump of every thread's Python stack after PROBE_DUMP_S seconds (hang diagnosis)."""
import faulthandler
import os
import sys

sys.path.insert(0, os.getcwd())
faulthandler.dump_traceback_later(float(os.environ.get("PROBE_DUMP_S", "70")), exit=False)
import main  # noqa: E402

code = main.main(sys.argv[1:])
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
