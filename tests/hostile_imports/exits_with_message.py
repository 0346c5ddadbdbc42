"""An adapter module that ends its process with a message as it is imported (status 1: "a finding")."""
import sys

sys.exit("this adapter needs a GPU")
