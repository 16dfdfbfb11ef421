"""The method protocol on the runtime side: what a decoding method declares (method) and the registry that lists
them (registry). The methods themselves are the folders of streamfuse.methods, found by name."""
