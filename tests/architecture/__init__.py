"""The seams and layers of the code, read from its source: boundaries, import graphs, import names."""
