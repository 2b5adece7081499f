"""What the server and client sides share: run config, models, data, partitions, protocol."""
