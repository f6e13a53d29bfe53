"""The one part of the build that pyproject.toml cannot declare: the optional C kernel of the statistics
(``layerdiff/tracefile/fastmoments.c``). Where no C compiler is present the install goes on without it and numpy
takes the statistics (``layerdiff.tracefile.tensors.summarize``), with the same results to ~1e-7."""
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    """Optimizing flags for compilers that take them (GCC, Clang); others build the kernel with their defaults."""

    def build_extensions(self):
        if self.compiler.compiler_type == "unix":
            for extension in self.extensions:
                extension.extra_compile_args = ["-O3", "-fopenmp-simd"]
        super().build_extensions()


setup(ext_modules=[Extension("layerdiff.tracefile.fastmoments", ["layerdiff/tracefile/fastmoments.c"],
                             optional=True)],
      cmdclass={"build_ext": BuildExt})
