"""The names, version and chunk sizes of the trace file: what its writer and reader agree on."""
import importlib
from types import ModuleType

FORMAT_NAME = "layerdiff-trace"
FORMAT_VERSION = 3  # the newest this layerdiff reads and writes, and the one every trace is written in.
# 3: checksums (every index line, every stored tensor, the metadata: ``checksums``), op records (``ops`` tracing),
# producers. 2: param_grad_use records (a tied weight's gradient per use), arg_names, tied. Traces of versions 1
# and 2 are read without verification.
DATA_CHUNK = 1 << 20
INDEX_CHUNK = 1 << 18  # 4,096 chunks a chunk-index node (writer._INDEX_NODE_K): a node splits past 1 GB of index
COMPRESSIONS = (None, "gzip", "lzf")


def load_h5py() -> ModuleType:
    """h5py, imported when a trace is opened (a core dependency, imported late so `layerdiff --help` stays fast)."""
    return importlib.import_module("h5py")
