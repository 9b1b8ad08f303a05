"""The server view's panes (kvtui attach, replay of a server trace): the prefix tree, the selected block, the
server's numbers and the notes; each draws frozen values built in engine/server/view.py."""
