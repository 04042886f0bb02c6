from graphtrain.cli.main import program

program()
