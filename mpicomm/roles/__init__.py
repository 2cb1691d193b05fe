"""How ranks cooperate: peers (synchronous, local SGD, gossip) and, later, parameter
servers + workers."""
