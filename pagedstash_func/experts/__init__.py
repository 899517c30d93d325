"""The experts of one layer: the dispatch plan (which buffer row each pair takes) and the
SwiGLU experts as one lean ``autograd.Function`` that stashes and pops its saved rows."""
