from graphtrain.cli import program

program()
