"""HTTP: the RSGI application, its route table, wire encoding and the one error mapping."""
