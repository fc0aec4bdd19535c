"""python generate.py: the command line of fastllama/generate.py, where the code is."""
from fastllama.generate import cli

if __name__ == "__main__":
    cli()
