"""The names, version and chunk sizes of the trace file: what its writer and reader agree on."""
import importlib
import struct
from types import ModuleType

FORMAT_NAME = "layerdiff-trace"
FORMAT_VERSION = 3  # the newest this layerdiff reads and writes, and the one every trace is written in.
# 3: checksums (every index line, every stored tensor, the metadata: ``checksums``), op records (``ops`` tracing),
# producers. 2: param_grad_use records (a tied weight's gradient per use), arg_names, tied. Traces of versions 1
# and 2 are read without verification.
DATA_CHUNK = 1 << 20
INDEX_CHUNK = 1 << 18  # 4,096 chunks a chunk-index node (writer._INDEX_NODE_K): a node splits past 1 GB of index
COMPRESSIONS = (None, "gzip", "lzf")
SUPERBLOCK_HEAD = 52  # bytes of a version-0 or -1 superblock up to and including its end-of-file address


def end_address_at(head: bytes) -> int | None:
    """Where the superblock that begins ``head`` keeps the file's end-of-allocation address (8 bytes, little-endian,
    no checksum, so the writer can move it and the reader can show another): superblock versions 0 and 1, which
    the writer makes, with 8-byte addresses and the file at base address 0. None for anything else."""
    if len(head) < SUPERBLOCK_HEAD or head[:8] != b"\x89HDF\r\n\x1a\n" or head[8] not in (0, 1) or head[13] != 8:
        return None
    position = 40 if head[8] == 0 else 44  # version 1 has 4 more bytes before the addresses (its istore K)
    return position if struct.unpack_from("<Q", head, position - 16)[0] == 0 else None


def load_h5py() -> ModuleType:
    """h5py, imported when a trace is opened (a core dependency, imported late so `layerdiff --help` stays fast)."""
    return importlib.import_module("h5py")
