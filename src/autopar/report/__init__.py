"""Views of a plan for people: explain, Chrome traces and Gantt charts, graphviz."""
