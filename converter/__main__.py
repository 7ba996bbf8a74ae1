"""``python -m converter`` = the ``k3convert`` command (for machines where it is not installed)."""
from .cli import main

main()
