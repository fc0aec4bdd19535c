"""python serve.py: the command line of fastllama/serve.py, where the code is."""
from fastllama.serve import cli

if __name__ == "__main__":
    cli()
