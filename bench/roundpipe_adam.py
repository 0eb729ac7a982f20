"""Build RoundPipe's CPU Adam (a C++ extension it compiles with ninja on first use) ahead of its
rows, so that its JIT build does not land in a measured run: ``python3 bench/roundpipe_adam.py``.

RoundPipe's package import starts its GPU threads and reads the free GPU memory, so the builder
module is loaded by its path, without importing the package. bench/peer_session.sh,
bench/families.sh and bench/long_rows.sh run it in the background."""
import importlib.util
import os

root = importlib.util.find_spec("roundpipe").submodule_search_locations[0]
spec = importlib.util.spec_from_file_location("rp_optim_builder", os.path.join(root, "optim", "optim_builder.py"))
builder = importlib.util.module_from_spec(spec)
spec.loader.exec_module(builder)
builder.load_optim_function("adam")
print("roundpipe adam ready")
