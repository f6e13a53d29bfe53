"""The part of the build that pyproject.toml cannot declare: compiled code, all of it optional.

- The C kernel of the statistics (``layerdiff/tracefile/fastmoments.c``). Where no C compiler is present the
  install goes on without it and numpy takes the statistics (``layerdiff.tracefile.tensors.summarize``), with the
  same results to ~1e-7.
- The recording's hot modules (``NATIVE``: the trace session, the operation capture, the trace writer), compiled
  from their unchanged Python sources by mypyc. Why: a trace with ``ops=True`` spends most of its cost in
  layerdiff's own Python per record (a few microseconds each, hundreds of records a step); compiled, its calls
  and attribute reads are C's. Where mypyc or a compiler is missing, the sources run as they are
  (``layerdiff/native.py`` also runs them where they changed since they were compiled).
"""
import json
import os
import runpy
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE_INFO = runpy.run_path(str(Path(__file__).resolve().parent / "layerdiff" / "native.py"))  # standard library only
NATIVE = [str(NATIVE_INFO["source"](module, Path("layerdiff"))) for module in NATIVE_INFO["NATIVE"]]
KERNEL = "layerdiff.tracefile.fastmoments"
SOURCES_FILE = f"layerdiff/{NATIVE_INFO['SOURCES_FILE']}"  # written by the build: the digests of the sources compiled


class BuildExt(build_ext):
    """Optimizing flags for compilers that take them (GCC, Clang); others build the kernel with their defaults.
    ``-ffinite-math-only -fno-signed-zeros``: the kernel's results are used only where every value was finite (a
    NaN or infinity makes its sums non-finite, at run time, and numpy's path takes over), and without them Clang
    leaves its min and max unvectorized (9x slower than GCC's build, 3x slower than numpy's path). Compile flags
    only: nothing of them reaches the link, which could change the process's floating-point modes.

    The compiled modules are all or none: one that fails to build drops the others (their C calls one another),
    and the digests of their sources are written only when every one was built."""

    def finalize_options(self):
        if all(e.name == KERNEL for e in self.distribution.ext_modules):  # mypyc's made only where they are built
            self.distribution.ext_modules += native_extensions()
        super().finalize_options()

    def build_extensions(self):
        kernel = [e for e in self.extensions if e.name == KERNEL]
        native = [e for e in self.extensions if e not in kernel]
        if self.compiler.compiler_type == "unix":
            for extension in kernel:
                extension.extra_compile_args = ["-O3", "-fopenmp-simd", "-ffinite-math-only", "-fno-signed-zeros"]
        self.extensions = kernel
        super().build_extensions()
        built = bool(native) and self._build_native(native)
        self.extensions = kernel + (native if built else [])  # what is copied beside the sources, and installed

    def _build_native(self, native: list) -> bool:
        """mypyc's extensions, and the digests of the sources they were compiled from; False where one failed."""
        self.extensions = native
        try:
            super().build_extensions()
        except Exception as exc:  # noqa: BLE001 - optional: the sources run as they are
            print(f"layerdiff: the recording's modules were not compiled ({exc}); they run from their sources")
            for extension in native:
                built = self.get_ext_fullpath(extension.name)
                if os.path.exists(built):
                    os.remove(built)
            return False
        target = os.path.join(self.build_lib, SOURCES_FILE)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as out:
            json.dump(NATIVE_INFO["source_digests"](Path("layerdiff")), out, indent=1)
        return True

    def copy_extensions_to_source(self):
        """An editable install: the digests beside the sources too (``layerdiff/native.py`` reads them there)."""
        super().copy_extensions_to_source()
        built = os.path.join(self.build_lib, SOURCES_FILE)
        if os.path.exists(built):
            self.copy_file(built, SOURCES_FILE, level=self.verbose)
        else:  # nothing compiled this time: an older build's modules and digests go, and the sources run
            for module in NATIVE_INFO["NATIVE"]:
                older = NATIVE_INFO["compiled"](module, Path("layerdiff"))
                if older is not None:
                    os.remove(older)
            if os.path.exists(SOURCES_FILE):
                os.remove(SOURCES_FILE)

    def get_outputs(self):
        compiling = any(e.name != KERNEL for e in self.extensions)  # the digests come with the compiled modules
        digests = [os.path.join(self.build_lib, SOURCES_FILE)] if compiling and not self.inplace else []
        return super().get_outputs() + digests


def native_extensions() -> list:
    """mypyc's extensions for ``NATIVE`` (none where mypyc is not installed, or ``LAYERDIFF_NATIVE=0``)."""
    if os.environ.get("LAYERDIFF_NATIVE", "1") == "0":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        return []
    try:
        return mypycify(NATIVE, opt_level="3", debug_level="1", group_name="layerdiff_native")
    except BaseException as exc:  # noqa: BLE001 - mypy found a type error, or a SystemExit from it: run the sources
        print(f"layerdiff: mypyc could not compile the recording's modules ({exc!r}); they run from their sources")
        return []


setup(ext_modules=[Extension(KERNEL, ["layerdiff/tracefile/fastmoments.c"],
                             optional=True)],
      cmdclass={"build_ext": BuildExt})
