"""decentral: low-communication, decentralized training."""
