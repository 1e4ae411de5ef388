"""`python -m stride.train ...`: `stride draft train` without the server's dependencies."""

import argparse
import sys

from stride.train.cli import configure, main

parser = argparse.ArgumentParser(
    prog="python -m stride.train", formatter_class=argparse.ArgumentDefaultsHelpFormatter
)
configure(parser)
sys.exit(main(parser.parse_args()))
