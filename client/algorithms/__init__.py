"""Client halves of the algorithms (one small file each); see common.registry."""
