"""Client side: the ClientApp, the local training loop, SAM machinery, client rules."""
