"""mindscale.launch.compiled_ir on hand-written IR text: how often a graph runs per step."""

from mindscale.launch.compiled_ir import collectives_of, parse_ir

# A backward closure called once per micro batch in the `%n[@@g](.., UMonad)` form: the last pipeline stage's
# under 2D tensor parallel (MindSpore 2.9's validate IR)
IR = """subgraph @backward_7(%para1_x) {
  %1(CNode_1) = AllReduce(%para1_x) {instance name: allreduce} primitive_attrs: {group_rank_ids: (0, 1)}
      : (<Tensor[Float32], (4, 8)>) -> (<Tensor[Float32], (4, 8)>)
}
subgraph @step_1(%para2_y) {
  %1(CNode_2) = Partial(@backward_7, %para2_y)
  %2(CNode_3) = %1[@@backward_7](%para2_y, UMonad[U]) cnode_attrs: {micro: I64(0)}
  %3(CNode_4) = %1[@@backward_7](%para2_y, UMonad[U]) cnode_attrs: {micro: I64(1)}
}
"""


def test_a_graph_called_with_a_monad_counts_once_per_call():
    [reduce] = collectives_of(parse_ir(IR, 0))[0]
    assert (reduce["kind"], reduce["count"], reduce["bytes"]) == ("AllReduce", 2, 2 * 4 * 8 * 4)
