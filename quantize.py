"""python quantize.py: the command line of fastllama/quantize.py, where the code is."""
from fastllama.quantize import cli

if __name__ == "__main__":
    cli()
