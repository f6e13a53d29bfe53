"""The one part of the build that pyproject.toml cannot declare: the optional C kernel of the statistics
(``layerdiff/tracefile/fastmoments.c``). Where no C compiler is present the install goes on without it and numpy
takes the statistics (``layerdiff.tracefile.tensors.summarize``), with the same results to ~1e-7."""
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    """Optimizing flags for compilers that take them (GCC, Clang); others build the kernel with their defaults.
    ``-ffinite-math-only -fno-signed-zeros``: the kernel's results are used only where every value was finite (a
    NaN or infinity makes its sums non-finite, at run time, and numpy's path takes over), and without them Clang
    leaves its min and max unvectorized (9x slower than GCC's build, 3x slower than numpy's path). Compile flags
    only: nothing of them reaches the link, which could change the process's floating-point modes."""

    def build_extensions(self):
        if self.compiler.compiler_type == "unix":
            for extension in self.extensions:
                extension.extra_compile_args = ["-O3", "-fopenmp-simd", "-ffinite-math-only", "-fno-signed-zeros"]
        super().build_extensions()


setup(ext_modules=[Extension("layerdiff.tracefile.fastmoments", ["layerdiff/tracefile/fastmoments.c"],
                             optional=True)],
      cmdclass={"build_ext": BuildExt})
