"""``python -m kvfs.cli`` runs the kvfs command."""
from kvfs.cli import main

main()
