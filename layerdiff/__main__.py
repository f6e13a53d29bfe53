import sys

from layerdiff.cli import main

sys.exit(main())
