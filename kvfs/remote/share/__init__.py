"""Scale-out: several kvfs nodes on one shared remote volume (format 2; docs/scale-out.md).

kvfs.build.attach_shared hooks a mount's SharedNames (adopt.py) into the tier, store and fs layer."""
