# glmc: the training step after 'recompute' (1212 nodes)



def forward(self, parameter_0, parameter_1, parameter_2, parameter_3, parameter_4, parameter_5, parameter_6, parameter_7, parameter_8, parameter_9, parameter_10, parameter_11, parameter_12, parameter_13, parameter_14, parameter_15, parameter_16, parameter_17, parameter_18, parameter_19, parameter_20, parameter_21, parameter_22, parameter_23, parameter_24, buffer_25, buffer_26, hyperparam_27, optimizer_state_28, optimizer_state_29, optimizer_state_30, optimizer_state_31, optimizer_state_32, optimizer_state_33, optimizer_state_34, optimizer_state_35, optimizer_state_36, optimizer_state_37, optimizer_state_38, optimizer_state_39, optimizer_state_40, optimizer_state_41, optimizer_state_42, optimizer_state_43, optimizer_state_44, optimizer_state_45, optimizer_state_46, optimizer_state_47, optimizer_state_48, optimizer_state_49, optimizer_state_50, optimizer_state_51, optimizer_state_52, optimizer_state_53, optimizer_state_54, optimizer_state_55, optimizer_state_56, optimizer_state_57, optimizer_state_58, optimizer_state_59, optimizer_state_60, optimizer_state_61, optimizer_state_62, optimizer_state_63, optimizer_state_64, optimizer_state_65, optimizer_state_66, optimizer_state_67, optimizer_state_68, optimizer_state_69, optimizer_state_70, optimizer_state_71, optimizer_state_72, optimizer_state_73, optimizer_state_74, optimizer_state_75, optimizer_state_76, optimizer_state_77, optimizer_state_78, optimizer_state_79, optimizer_state_80, optimizer_state_81, optimizer_state_82, optimizer_state_83, optimizer_state_84, optimizer_state_85, optimizer_state_86, optimizer_state_87, optimizer_state_88, optimizer_state_89, optimizer_state_90, optimizer_state_91, optimizer_state_92, optimizer_state_93, optimizer_state_94, optimizer_state_95, optimizer_state_96, optimizer_state_97, optimizer_state_98, optimizer_state_99, optimizer_state_100, optimizer_state_101, optimizer_state_102, input_103, input_104):
    slice_1 = torch.ops.aten.slice.Tensor(buffer_25, 0, 0, 32);  buffer_25 = None
    slice_2 = torch.ops.aten.slice.Tensor(buffer_26, 0, 0, 32);  buffer_26 = None
    embedding = torch.ops.aten.embedding.default(parameter_0, input_103)
    pow_1 = torch.ops.aten.pow.Tensor_Scalar(embedding, 2)
    mean = torch.ops.aten.mean.dim(pow_1, [-1], True);  pow_1 = None
    add = torch.ops.aten.add.Tensor(mean, 1e-05);  mean = None
    rsqrt = torch.ops.aten.rsqrt.default(add);  add = None
    mul = torch.ops.aten.mul.Tensor(embedding, rsqrt)
    mul_1 = torch.ops.aten.mul.Tensor(mul, parameter_1);  mul = None
    view = torch.ops.aten.view.default(mul_1, [128, 64]);  mul_1 = None
    t = torch.ops.aten.t.default(parameter_2)
    addmm = torch.ops.aten.addmm.default(parameter_3, view, t)
    view_1 = torch.ops.aten.view.default(addmm, [4, 32, 64]);  addmm = None
    view_2 = torch.ops.aten.view.default(view_1, [4, 32, 4, 16]);  view_1 = None
    transpose = torch.ops.aten.transpose.int(view_2, 1, 2);  view_2 = None
    t_1 = torch.ops.aten.t.default(parameter_4)
    addmm_1 = torch.ops.aten.addmm.default(parameter_5, view, t_1)
    view_4 = torch.ops.aten.view.default(addmm_1, [4, 32, 32]);  addmm_1 = None
    view_5 = torch.ops.aten.view.default(view_4, [4, 32, 2, 16]);  view_4 = None
    transpose_1 = torch.ops.aten.transpose.int(view_5, 1, 2);  view_5 = None
    t_2 = torch.ops.aten.t.default(parameter_6)
    addmm_2 = torch.ops.aten.addmm.default(parameter_7, view, t_2);  view = None
    view_7 = torch.ops.aten.view.default(addmm_2, [4, 32, 32]);  addmm_2 = None
    view_8 = torch.ops.aten.view.default(view_7, [4, 32, 2, 16]);  view_7 = None
    transpose_2 = torch.ops.aten.transpose.int(view_8, 1, 2);  view_8 = None
    slice_3 = torch.ops.aten.slice.Tensor(transpose, 3, 8, 9223372036854775807)
    neg = torch.ops.aten.neg.default(slice_3);  slice_3 = None
    slice_4 = torch.ops.aten.slice.Tensor(transpose, 3, 0, 8)
    cat = torch.ops.aten.cat.default([neg, slice_4], -1);  neg = slice_4 = None
    mul_2 = torch.ops.aten.mul.Tensor(transpose, slice_1);  transpose = None
    mul_3 = torch.ops.aten.mul.Tensor(cat, slice_2);  cat = None
    add_1 = torch.ops.aten.add.Tensor(mul_2, mul_3);  mul_2 = mul_3 = None
    slice_5 = torch.ops.aten.slice.Tensor(transpose_1, 3, 8, 9223372036854775807)
    neg_1 = torch.ops.aten.neg.default(slice_5);  slice_5 = None
    slice_6 = torch.ops.aten.slice.Tensor(transpose_1, 3, 0, 8)
    cat_1 = torch.ops.aten.cat.default([neg_1, slice_6], -1);  neg_1 = slice_6 = None
    mul_4 = torch.ops.aten.mul.Tensor(transpose_1, slice_1);  transpose_1 = None
    mul_5 = torch.ops.aten.mul.Tensor(cat_1, slice_2);  cat_1 = None
    add_2 = torch.ops.aten.add.Tensor(mul_4, mul_5);  mul_4 = mul_5 = None
    unsqueeze = torch.ops.aten.unsqueeze.default(add_2, 2);  add_2 = None
    expand = torch.ops.aten.expand.default(unsqueeze, [4, 2, 2, 32, 16]);  unsqueeze = None
    clone = torch.ops.aten.clone.default(expand, memory_format = torch.contiguous_format)
    view_9 = torch.ops.aten.view.default(clone, [4, 4, 32, 16]);  clone = None
    unsqueeze_1 = torch.ops.aten.unsqueeze.default(transpose_2, 2);  transpose_2 = None
    expand_1 = torch.ops.aten.expand.default(unsqueeze_1, [4, 2, 2, 32, 16]);  unsqueeze_1 = None
    clone_1 = torch.ops.aten.clone.default(expand_1, memory_format = torch.contiguous_format);  expand_1 = None
    view_10 = torch.ops.aten.view.default(clone_1, [4, 4, 32, 16]);  clone_1 = None
    transpose_3 = torch.ops.aten.transpose.int(view_9, -2, -1);  view_9 = None
    clone_2 = torch.ops.aten.clone.default(add_1, memory_format = torch.contiguous_format);  add_1 = None
    _unsafe_view = torch.ops.aten._unsafe_view.default(clone_2, [16, 32, 16]);  clone_2 = None
    view_11 = torch.ops.aten.view.default(transpose_3, [16, 16, 32]);  transpose_3 = None
    bmm = torch.ops.aten.bmm.default(_unsafe_view, view_11);  view_11 = None
    view_12 = torch.ops.aten.view.default(bmm, [4, 4, 32, 32]);  bmm = None
    div = torch.ops.aten.div.Tensor(view_12, 4.0);  view_12 = None
    ones = torch.ops.aten.ones.default([32, 32], dtype = torch.bool, device = device(type='cpu'), pin_memory = False)
    triu = torch.ops.aten.triu.default(ones, 1);  ones = None
    masked_fill = torch.ops.aten.masked_fill.Scalar(div, triu, -inf);  div = None
    _softmax = torch.ops.aten._softmax.default(masked_fill, -1, False);  masked_fill = None
    view_13 = torch.ops.aten.view.default(_softmax, [16, 32, 32])
    view_14 = torch.ops.aten.view.default(view_10, [16, 32, 16]);  view_10 = None
    bmm_1 = torch.ops.aten.bmm.default(view_13, view_14);  view_14 = None
    view_15 = torch.ops.aten.view.default(bmm_1, [4, 4, 32, 16]);  bmm_1 = None
    transpose_4 = torch.ops.aten.transpose.int(view_15, 1, 2);  view_15 = None
    clone_4 = torch.ops.aten.clone.default(transpose_4, memory_format = torch.contiguous_format);  transpose_4 = None
    _unsafe_view_1 = torch.ops.aten._unsafe_view.default(clone_4, [4, 32, 64]);  clone_4 = None
    t_3 = torch.ops.aten.t.default(parameter_8)
    view_16 = torch.ops.aten.view.default(_unsafe_view_1, [128, 64]);  _unsafe_view_1 = None
    mm = torch.ops.aten.mm.default(view_16, t_3);  view_16 = None
    _unsafe_view_2 = torch.ops.aten._unsafe_view.default(mm, [4, 32, 64]);  mm = None
    add_3 = torch.ops.aten.add.Tensor(embedding, _unsafe_view_2);  embedding = _unsafe_view_2 = None
    pow_2 = torch.ops.aten.pow.Tensor_Scalar(add_3, 2)
    mean_1 = torch.ops.aten.mean.dim(pow_2, [-1], True);  pow_2 = None
    add_4 = torch.ops.aten.add.Tensor(mean_1, 1e-05);  mean_1 = None
    rsqrt_1 = torch.ops.aten.rsqrt.default(add_4);  add_4 = None
    mul_6 = torch.ops.aten.mul.Tensor(add_3, rsqrt_1)
    mul_7 = torch.ops.aten.mul.Tensor(mul_6, parameter_9);  mul_6 = None
    t_4 = torch.ops.aten.t.default(parameter_10)
    view_17 = torch.ops.aten.view.default(mul_7, [128, 64]);  mul_7 = None
    mm_1 = torch.ops.aten.mm.default(view_17, t_4);  view_17 = None
    _unsafe_view_3 = torch.ops.aten._unsafe_view.default(mm_1, [4, 32, 344]);  mm_1 = None
    split = torch.ops.aten.split.Tensor(_unsafe_view_3, 172, -1);  _unsafe_view_3 = None
    getitem = split[0]
    getitem_1 = split[1];  split = None
    silu = torch.ops.aten.silu.default(getitem);  getitem = None
    mul_8 = torch.ops.aten.mul.Tensor(silu, getitem_1);  silu = getitem_1 = None
    t_5 = torch.ops.aten.t.default(parameter_11)
    view_18 = torch.ops.aten.view.default(mul_8, [128, 172]);  mul_8 = None
    mm_2 = torch.ops.aten.mm.default(view_18, t_5);  view_18 = None
    _unsafe_view_4 = torch.ops.aten._unsafe_view.default(mm_2, [4, 32, 64]);  mm_2 = None
    add_5 = torch.ops.aten.add.Tensor(add_3, _unsafe_view_4);  _unsafe_view_4 = None
    pow_3 = torch.ops.aten.pow.Tensor_Scalar(add_5, 2)
    mean_2 = torch.ops.aten.mean.dim(pow_3, [-1], True);  pow_3 = None
    add_6 = torch.ops.aten.add.Tensor(mean_2, 1e-05);  mean_2 = None
    rsqrt_2 = torch.ops.aten.rsqrt.default(add_6);  add_6 = None
    mul_9 = torch.ops.aten.mul.Tensor(add_5, rsqrt_2)
    mul_10 = torch.ops.aten.mul.Tensor(mul_9, parameter_12);  mul_9 = None
    view_19 = torch.ops.aten.view.default(mul_10, [128, 64]);  mul_10 = None
    t_6 = torch.ops.aten.t.default(parameter_13)
    addmm_3 = torch.ops.aten.addmm.default(parameter_14, view_19, t_6)
    view_20 = torch.ops.aten.view.default(addmm_3, [4, 32, 64]);  addmm_3 = None
    view_21 = torch.ops.aten.view.default(view_20, [4, 32, 4, 16]);  view_20 = None
    transpose_5 = torch.ops.aten.transpose.int(view_21, 1, 2);  view_21 = None
    t_7 = torch.ops.aten.t.default(parameter_15)
    addmm_4 = torch.ops.aten.addmm.default(parameter_16, view_19, t_7)
    view_23 = torch.ops.aten.view.default(addmm_4, [4, 32, 32]);  addmm_4 = None
    view_24 = torch.ops.aten.view.default(view_23, [4, 32, 2, 16]);  view_23 = None
    transpose_6 = torch.ops.aten.transpose.int(view_24, 1, 2);  view_24 = None
    t_8 = torch.ops.aten.t.default(parameter_17)
    addmm_5 = torch.ops.aten.addmm.default(parameter_18, view_19, t_8);  view_19 = None
    view_26 = torch.ops.aten.view.default(addmm_5, [4, 32, 32]);  addmm_5 = None
    view_27 = torch.ops.aten.view.default(view_26, [4, 32, 2, 16]);  view_26 = None
    transpose_7 = torch.ops.aten.transpose.int(view_27, 1, 2);  view_27 = None
    slice_7 = torch.ops.aten.slice.Tensor(transpose_5, 3, 8, 9223372036854775807)
    neg_2 = torch.ops.aten.neg.default(slice_7);  slice_7 = None
    slice_8 = torch.ops.aten.slice.Tensor(transpose_5, 3, 0, 8)
    cat_2 = torch.ops.aten.cat.default([neg_2, slice_8], -1);  neg_2 = slice_8 = None
    mul_11 = torch.ops.aten.mul.Tensor(transpose_5, slice_1);  transpose_5 = None
    mul_12 = torch.ops.aten.mul.Tensor(cat_2, slice_2);  cat_2 = None
    add_7 = torch.ops.aten.add.Tensor(mul_11, mul_12);  mul_11 = mul_12 = None
    slice_9 = torch.ops.aten.slice.Tensor(transpose_6, 3, 8, 9223372036854775807)
    neg_3 = torch.ops.aten.neg.default(slice_9);  slice_9 = None
    slice_10 = torch.ops.aten.slice.Tensor(transpose_6, 3, 0, 8)
    cat_3 = torch.ops.aten.cat.default([neg_3, slice_10], -1);  neg_3 = slice_10 = None
    mul_13 = torch.ops.aten.mul.Tensor(transpose_6, slice_1);  transpose_6 = None
    mul_14 = torch.ops.aten.mul.Tensor(cat_3, slice_2);  cat_3 = None
    add_8 = torch.ops.aten.add.Tensor(mul_13, mul_14);  mul_13 = mul_14 = None
    unsqueeze_2 = torch.ops.aten.unsqueeze.default(add_8, 2);  add_8 = None
    expand_6 = torch.ops.aten.expand.default(unsqueeze_2, [4, 2, 2, 32, 16]);  unsqueeze_2 = None
    clone_5 = torch.ops.aten.clone.default(expand_6, memory_format = torch.contiguous_format)
    view_28 = torch.ops.aten.view.default(clone_5, [4, 4, 32, 16]);  clone_5 = None
    unsqueeze_3 = torch.ops.aten.unsqueeze.default(transpose_7, 2);  transpose_7 = None
    expand_7 = torch.ops.aten.expand.default(unsqueeze_3, [4, 2, 2, 32, 16]);  unsqueeze_3 = None
    clone_6 = torch.ops.aten.clone.default(expand_7, memory_format = torch.contiguous_format);  expand_7 = None
    view_29 = torch.ops.aten.view.default(clone_6, [4, 4, 32, 16]);  clone_6 = None
    transpose_8 = torch.ops.aten.transpose.int(view_28, -2, -1);  view_28 = None
    clone_7 = torch.ops.aten.clone.default(add_7, memory_format = torch.contiguous_format);  add_7 = None
    _unsafe_view_5 = torch.ops.aten._unsafe_view.default(clone_7, [16, 32, 16]);  clone_7 = None
    view_30 = torch.ops.aten.view.default(transpose_8, [16, 16, 32]);  transpose_8 = None
    bmm_2 = torch.ops.aten.bmm.default(_unsafe_view_5, view_30);  view_30 = None
    view_31 = torch.ops.aten.view.default(bmm_2, [4, 4, 32, 32]);  bmm_2 = None
    div_1 = torch.ops.aten.div.Tensor(view_31, 4.0);  view_31 = None
    masked_fill_1 = torch.ops.aten.masked_fill.Scalar(div_1, triu, -inf);  div_1 = None
    _softmax_1 = torch.ops.aten._softmax.default(masked_fill_1, -1, False);  masked_fill_1 = None
    view_32 = torch.ops.aten.view.default(_softmax_1, [16, 32, 32])
    view_33 = torch.ops.aten.view.default(view_29, [16, 32, 16]);  view_29 = None
    bmm_3 = torch.ops.aten.bmm.default(view_32, view_33);  view_33 = None
    view_34 = torch.ops.aten.view.default(bmm_3, [4, 4, 32, 16]);  bmm_3 = None
    transpose_9 = torch.ops.aten.transpose.int(view_34, 1, 2);  view_34 = None
    clone_9 = torch.ops.aten.clone.default(transpose_9, memory_format = torch.contiguous_format);  transpose_9 = None
    _unsafe_view_6 = torch.ops.aten._unsafe_view.default(clone_9, [4, 32, 64]);  clone_9 = None
    t_9 = torch.ops.aten.t.default(parameter_19)
    view_35 = torch.ops.aten.view.default(_unsafe_view_6, [128, 64]);  _unsafe_view_6 = None
    mm_3 = torch.ops.aten.mm.default(view_35, t_9)
    _unsafe_view_7 = torch.ops.aten._unsafe_view.default(mm_3, [4, 32, 64]);  mm_3 = None
    add_9 = torch.ops.aten.add.Tensor(add_5, _unsafe_view_7);  _unsafe_view_7 = None
    pow_4 = torch.ops.aten.pow.Tensor_Scalar(add_9, 2)
    mean_3 = torch.ops.aten.mean.dim(pow_4, [-1], True);  pow_4 = None
    add_10 = torch.ops.aten.add.Tensor(mean_3, 1e-05);  mean_3 = None
    rsqrt_3 = torch.ops.aten.rsqrt.default(add_10);  add_10 = None
    mul_15 = torch.ops.aten.mul.Tensor(add_9, rsqrt_3)
    mul_16 = torch.ops.aten.mul.Tensor(mul_15, parameter_20);  mul_15 = None
    t_10 = torch.ops.aten.t.default(parameter_21)
    view_36 = torch.ops.aten.view.default(mul_16, [128, 64]);  mul_16 = None
    mm_4 = torch.ops.aten.mm.default(view_36, t_10)
    _unsafe_view_8 = torch.ops.aten._unsafe_view.default(mm_4, [4, 32, 344]);  mm_4 = None
    split_1 = torch.ops.aten.split.Tensor(_unsafe_view_8, 172, -1);  _unsafe_view_8 = None
    getitem_2 = split_1[0]
    getitem_3 = split_1[1];  split_1 = None
    silu_1 = torch.ops.aten.silu.default(getitem_2);  getitem_2 = None
    mul_17 = torch.ops.aten.mul.Tensor(silu_1, getitem_3);  silu_1 = getitem_3 = None
    t_11 = torch.ops.aten.t.default(parameter_22)
    view_37 = torch.ops.aten.view.default(mul_17, [128, 172]);  mul_17 = None
    mm_5 = torch.ops.aten.mm.default(view_37, t_11)
    _unsafe_view_9 = torch.ops.aten._unsafe_view.default(mm_5, [4, 32, 64]);  mm_5 = None
    add_11 = torch.ops.aten.add.Tensor(add_9, _unsafe_view_9);  _unsafe_view_9 = None
    pow_5 = torch.ops.aten.pow.Tensor_Scalar(add_11, 2)
    mean_4 = torch.ops.aten.mean.dim(pow_5, [-1], True);  pow_5 = None
    add_12 = torch.ops.aten.add.Tensor(mean_4, 1e-05);  mean_4 = None
    rsqrt_4 = torch.ops.aten.rsqrt.default(add_12);  add_12 = None
    mul_18 = torch.ops.aten.mul.Tensor(add_11, rsqrt_4)
    mul_19 = torch.ops.aten.mul.Tensor(mul_18, parameter_23)
    t_12 = torch.ops.aten.t.default(parameter_24)
    view_38 = torch.ops.aten.view.default(mul_19, [128, 64]);  mul_19 = None
    mm_6 = torch.ops.aten.mm.default(view_38, t_12)
    _unsafe_view_10 = torch.ops.aten._unsafe_view.default(mm_6, [4, 32, 256]);  mm_6 = None
    slice_11 = torch.ops.aten.slice.Tensor(_unsafe_view_10, 1, 0, -1);  _unsafe_view_10 = None
    clone_10 = torch.ops.aten.clone.default(slice_11, memory_format = torch.contiguous_format);  slice_11 = None
    _unsafe_view_11 = torch.ops.aten._unsafe_view.default(clone_10, [124, 256]);  clone_10 = None
    slice_12 = torch.ops.aten.slice.Tensor(input_104, 1, 1, 9223372036854775807);  input_104 = None
    clone_11 = torch.ops.aten.clone.default(slice_12, memory_format = torch.contiguous_format);  slice_12 = None
    _unsafe_view_12 = torch.ops.aten._unsafe_view.default(clone_11, [124]);  clone_11 = None
    _log_softmax = torch.ops.aten._log_softmax.default(_unsafe_view_11, 1, False);  _unsafe_view_11 = None
    nll_loss_forward = torch.ops.aten.nll_loss_forward.default(_log_softmax, _unsafe_view_12, None, 1, -100)
    getitem_4 = nll_loss_forward[0]
    ones_like_default = torch.ops.aten.ones_like.default(getitem_4)
    getitem_5 = nll_loss_forward[1];  nll_loss_forward = None
    nll_loss_backward = torch.ops.aten.nll_loss_backward.default(ones_like_default, _log_softmax, _unsafe_view_12, None, 1, -100, getitem_5);  ones_like_default = _unsafe_view_12 = getitem_5 = None
    _log_softmax_backward_data = torch.ops.aten._log_softmax_backward_data.default(nll_loss_backward, _log_softmax, 1, torch.float32);  nll_loss_backward = _log_softmax = None
    view_39 = torch.ops.aten.view.default(_log_softmax_backward_data, [4, 31, 256]);  _log_softmax_backward_data = None
    slice_backward = torch.ops.aten.slice_backward.default(view_39, [4, 32, 256], 1, 0, -1, 1);  view_39 = None
    view_40 = torch.ops.aten.view.default(slice_backward, [128, 256]);  slice_backward = None
    t_13 = torch.ops.aten.t.default(view_40)
    mm_7 = torch.ops.aten.mm.default(t_13, view_38);  t_13 = view_38 = None
    t_14 = torch.ops.aten.t.default(mm_7);  mm_7 = None
    t_15 = torch.ops.aten.t.default(t_12);  t_12 = None
    mm_8 = torch.ops.aten.mm.default(view_40, t_15);  view_40 = t_15 = None
    view_41 = torch.ops.aten.view.default(mm_8, [4, 32, 64]);  mm_8 = None
    t_16 = torch.ops.aten.t.default(t_14);  t_14 = None
    mul_20 = torch.ops.aten.mul.Tensor(view_41, mul_18);  mul_18 = None
    mul_21 = torch.ops.aten.mul.Tensor(view_41, parameter_23);  view_41 = None
    sum_1 = torch.ops.aten.sum.dim_IntList(mul_20, [0, 1], True);  mul_20 = None
    view_42 = torch.ops.aten.view.default(sum_1, [64]);  sum_1 = None
    mul_22 = torch.ops.aten.mul.Tensor(mul_21, add_11)
    mul_23 = torch.ops.aten.mul.Tensor(mul_21, rsqrt_4);  mul_21 = None
    sum_2 = torch.ops.aten.sum.dim_IntList(mul_22, [2], True);  mul_22 = None
    pow_6 = torch.ops.aten.pow.Tensor_Scalar(rsqrt_4, 3);  rsqrt_4 = None
    mul_24 = torch.ops.aten.mul.Scalar(sum_2, -0.5);  sum_2 = None
    mul_25 = torch.ops.aten.mul.Tensor(mul_24, pow_6);  mul_24 = pow_6 = None
    expand_12 = torch.ops.aten.expand.default(mul_25, [4, 32, 64]);  mul_25 = None
    div_2 = torch.ops.aten.div.Scalar(expand_12, 64);  expand_12 = None
    pow_7 = torch.ops.aten.pow.Tensor_Scalar(add_11, 1.0);  add_11 = None
    mul_26 = torch.ops.aten.mul.Scalar(pow_7, 2.0);  pow_7 = None
    mul_27 = torch.ops.aten.mul.Tensor(div_2, mul_26);  div_2 = mul_26 = None
    add_13 = torch.ops.aten.add.Tensor(mul_23, mul_27);  mul_23 = mul_27 = None
    view_43 = torch.ops.aten.view.default(add_13, [128, 64])
    t_17 = torch.ops.aten.t.default(view_43)
    mm_9 = torch.ops.aten.mm.default(t_17, view_37);  t_17 = view_37 = None
    t_18 = torch.ops.aten.t.default(mm_9);  mm_9 = None
    t_19 = torch.ops.aten.t.default(t_11);  t_11 = None
    mm_10 = torch.ops.aten.mm.default(view_43, t_19);  view_43 = t_19 = None
    view_44 = torch.ops.aten.view.default(mm_10, [4, 32, 172]);  mm_10 = None
    t_20 = torch.ops.aten.t.default(t_18);  t_18 = None
    mm_default = torch.ops.aten.mm.default(view_36, t_10)
    _unsafe_view_default = torch.ops.aten._unsafe_view.default(mm_default, [4, 32, 344]);  mm_default = None
    split_tensor = torch.ops.aten.split.Tensor(_unsafe_view_default, 172, -1);  _unsafe_view_default = None
    getitem_6 = split_tensor[0]
    silu_default = torch.ops.aten.silu.default(getitem_6)
    mul_28 = torch.ops.aten.mul.Tensor(view_44, silu_default);  silu_default = None
    getitem_7 = split_tensor[1];  split_tensor = None
    mul_29 = torch.ops.aten.mul.Tensor(view_44, getitem_7);  view_44 = getitem_7 = None
    silu_backward = torch.ops.aten.silu_backward.default(mul_29, getitem_6);  mul_29 = getitem_6 = None
    cat_4 = torch.ops.aten.cat.default([silu_backward, mul_28], 2);  silu_backward = mul_28 = None
    view_45 = torch.ops.aten.view.default(cat_4, [128, 344]);  cat_4 = None
    t_21 = torch.ops.aten.t.default(view_45)
    mm_11 = torch.ops.aten.mm.default(t_21, view_36);  t_21 = view_36 = None
    t_22 = torch.ops.aten.t.default(mm_11);  mm_11 = None
    t_23 = torch.ops.aten.t.default(t_10);  t_10 = None
    mm_12 = torch.ops.aten.mm.default(view_45, t_23);  view_45 = t_23 = None
    view_46 = torch.ops.aten.view.default(mm_12, [4, 32, 64]);  mm_12 = None
    t_24 = torch.ops.aten.t.default(t_22);  t_22 = None
    mul_tensor = torch.ops.aten.mul.Tensor(add_9, rsqrt_3)
    mul_30 = torch.ops.aten.mul.Tensor(view_46, mul_tensor);  mul_tensor = None
    mul_31 = torch.ops.aten.mul.Tensor(view_46, parameter_20);  view_46 = None
    sum_3 = torch.ops.aten.sum.dim_IntList(mul_30, [0, 1], True);  mul_30 = None
    view_47 = torch.ops.aten.view.default(sum_3, [64]);  sum_3 = None
    mul_32 = torch.ops.aten.mul.Tensor(mul_31, add_9)
    mul_33 = torch.ops.aten.mul.Tensor(mul_31, rsqrt_3);  mul_31 = None
    sum_4 = torch.ops.aten.sum.dim_IntList(mul_32, [2], True);  mul_32 = None
    add_14 = torch.ops.aten.add.Tensor(add_13, mul_33);  add_13 = mul_33 = None
    pow_8 = torch.ops.aten.pow.Tensor_Scalar(rsqrt_3, 3);  rsqrt_3 = None
    mul_34 = torch.ops.aten.mul.Scalar(sum_4, -0.5);  sum_4 = None
    mul_35 = torch.ops.aten.mul.Tensor(mul_34, pow_8);  mul_34 = pow_8 = None
    expand_13 = torch.ops.aten.expand.default(mul_35, [4, 32, 64]);  mul_35 = None
    div_3 = torch.ops.aten.div.Scalar(expand_13, 64);  expand_13 = None
    pow_9 = torch.ops.aten.pow.Tensor_Scalar(add_9, 1.0);  add_9 = None
    mul_36 = torch.ops.aten.mul.Scalar(pow_9, 2.0);  pow_9 = None
    mul_37 = torch.ops.aten.mul.Tensor(div_3, mul_36);  div_3 = mul_36 = None
    add_15 = torch.ops.aten.add.Tensor(add_14, mul_37);  add_14 = mul_37 = None
    view_48 = torch.ops.aten.view.default(add_15, [128, 64])
    t_25 = torch.ops.aten.t.default(view_48)
    mm_13 = torch.ops.aten.mm.default(t_25, view_35);  t_25 = view_35 = None
    t_26 = torch.ops.aten.t.default(mm_13);  mm_13 = None
    t_27 = torch.ops.aten.t.default(t_9);  t_9 = None
    mm_14 = torch.ops.aten.mm.default(view_48, t_27);  view_48 = t_27 = None
    view_49 = torch.ops.aten.view.default(mm_14, [4, 32, 64]);  mm_14 = None
    t_28 = torch.ops.aten.t.default(t_26);  t_26 = None
    view_50 = torch.ops.aten.view.default(view_49, [4, 32, 4, 16]);  view_49 = None
    transpose_10 = torch.ops.aten.transpose.int(view_50, 1, 2);  view_50 = None
    clone_12 = torch.ops.aten.clone.default(transpose_10, memory_format = torch.contiguous_format);  transpose_10 = None
    _unsafe_view_13 = torch.ops.aten._unsafe_view.default(clone_12, [16, 32, 16]);  clone_12 = None
    transpose_11 = torch.ops.aten.transpose.int(view_32, 1, 2);  view_32 = None
    bmm_4 = torch.ops.aten.bmm.default(transpose_11, _unsafe_view_13);  transpose_11 = None
    mul_tensor_1 = torch.ops.aten.mul.Tensor(add_5, rsqrt_2)
    mul_tensor_2 = torch.ops.aten.mul.Tensor(mul_tensor_1, parameter_12)
    view_default = torch.ops.aten.view.default(mul_tensor_2, [128, 64]);  mul_tensor_2 = None
    addmm_default = torch.ops.aten.addmm.default(parameter_18, view_default, t_8)
    view_default_1 = torch.ops.aten.view.default(addmm_default, [4, 32, 32]);  addmm_default = None
    view_default_2 = torch.ops.aten.view.default(view_default_1, [4, 32, 2, 16]);  view_default_1 = None
    transpose_int = torch.ops.aten.transpose.int(view_default_2, 1, 2);  view_default_2 = None
    unsqueeze_default = torch.ops.aten.unsqueeze.default(transpose_int, 2);  transpose_int = None
    expand_default = torch.ops.aten.expand.default(unsqueeze_default, [4, 2, 2, 32, 16]);  unsqueeze_default = None
    clone_default = torch.ops.aten.clone.default(expand_default, memory_format = torch.contiguous_format);  expand_default = None
    view_default_3 = torch.ops.aten.view.default(clone_default, [4, 4, 32, 16]);  clone_default = None
    view_default_4 = torch.ops.aten.view.default(view_default_3, [16, 32, 16]);  view_default_3 = None
    transpose_12 = torch.ops.aten.transpose.int(view_default_4, 1, 2);  view_default_4 = None
    bmm_5 = torch.ops.aten.bmm.default(_unsafe_view_13, transpose_12);  _unsafe_view_13 = transpose_12 = None
    view_51 = torch.ops.aten.view.default(bmm_4, [4, 4, 32, 16]);  bmm_4 = None
    view_52 = torch.ops.aten.view.default(bmm_5, [4, 4, 32, 32]);  bmm_5 = None
    _softmax_backward_data = torch.ops.aten._softmax_backward_data.default(view_52, _softmax_1, -1, torch.float32);  view_52 = _softmax_1 = None
    masked_fill_2 = torch.ops.aten.masked_fill.Scalar(_softmax_backward_data, triu, 0);  _softmax_backward_data = None
    div_4 = torch.ops.aten.div.Tensor(masked_fill_2, 4.0);  masked_fill_2 = None
    view_53 = torch.ops.aten.view.default(div_4, [16, 32, 32]);  div_4 = None
    transpose_13 = torch.ops.aten.transpose.int(_unsafe_view_5, 1, 2);  _unsafe_view_5 = None
    bmm_6 = torch.ops.aten.bmm.default(transpose_13, view_53);  transpose_13 = None
    clone_default_1 = torch.ops.aten.clone.default(expand_6, memory_format = torch.contiguous_format);  expand_6 = None
    view_default_5 = torch.ops.aten.view.default(clone_default_1, [4, 4, 32, 16]);  clone_default_1 = None
    transpose_int_1 = torch.ops.aten.transpose.int(view_default_5, -2, -1);  view_default_5 = None
    view_default_6 = torch.ops.aten.view.default(transpose_int_1, [16, 16, 32]);  transpose_int_1 = None
    transpose_14 = torch.ops.aten.transpose.int(view_default_6, 1, 2);  view_default_6 = None
    bmm_7 = torch.ops.aten.bmm.default(view_53, transpose_14);  view_53 = transpose_14 = None
    view_54 = torch.ops.aten.view.default(bmm_6, [4, 4, 16, 32]);  bmm_6 = None
    view_55 = torch.ops.aten.view.default(bmm_7, [4, 4, 32, 16]);  bmm_7 = None
    transpose_15 = torch.ops.aten.transpose.int(view_54, -2, -1);  view_54 = None
    view_56 = torch.ops.aten.view.default(view_51, [4, 2, 2, 32, 16]);  view_51 = None
    sum_5 = torch.ops.aten.sum.dim_IntList(view_56, [2], True);  view_56 = None
    squeeze = torch.ops.aten.squeeze.dim(sum_5, 2);  sum_5 = None
    view_57 = torch.ops.aten.view.default(transpose_15, [4, 2, 2, 32, 16]);  transpose_15 = None
    sum_6 = torch.ops.aten.sum.dim_IntList(view_57, [2], True);  view_57 = None
    squeeze_1 = torch.ops.aten.squeeze.dim(sum_6, 2);  sum_6 = None
    mul_38 = torch.ops.aten.mul.Tensor(squeeze_1, slice_2)
    mul_39 = torch.ops.aten.mul.Tensor(squeeze_1, slice_1);  squeeze_1 = None
    slice_13 = torch.ops.aten.slice.Tensor(mul_38, 3, 0, 8)
    slice_14 = torch.ops.aten.slice.Tensor(mul_38, 3, 8, 16);  mul_38 = None
    slice_backward_1 = torch.ops.aten.slice_backward.default(slice_14, [4, 2, 32, 16], 3, 0, 8, 1);  slice_14 = None
    add_16 = torch.ops.aten.add.Tensor(mul_39, slice_backward_1);  mul_39 = slice_backward_1 = None
    neg_4 = torch.ops.aten.neg.default(slice_13);  slice_13 = None
    slice_backward_2 = torch.ops.aten.slice_backward.default(neg_4, [4, 2, 32, 16], 3, 8, 9223372036854775807, 1);  neg_4 = None
    add_17 = torch.ops.aten.add.Tensor(add_16, slice_backward_2);  add_16 = slice_backward_2 = None
    mul_40 = torch.ops.aten.mul.Tensor(view_55, slice_2)
    mul_41 = torch.ops.aten.mul.Tensor(view_55, slice_1);  view_55 = None
    slice_15 = torch.ops.aten.slice.Tensor(mul_40, 3, 0, 8)
    slice_16 = torch.ops.aten.slice.Tensor(mul_40, 3, 8, 16);  mul_40 = None
    slice_backward_3 = torch.ops.aten.slice_backward.default(slice_16, [4, 4, 32, 16], 3, 0, 8, 1);  slice_16 = None
    add_18 = torch.ops.aten.add.Tensor(mul_41, slice_backward_3);  mul_41 = slice_backward_3 = None
    neg_5 = torch.ops.aten.neg.default(slice_15);  slice_15 = None
    slice_backward_4 = torch.ops.aten.slice_backward.default(neg_5, [4, 4, 32, 16], 3, 8, 9223372036854775807, 1);  neg_5 = None
    add_19 = torch.ops.aten.add.Tensor(add_18, slice_backward_4);  add_18 = slice_backward_4 = None
    transpose_16 = torch.ops.aten.transpose.int(squeeze, 1, 2);  squeeze = None
    clone_13 = torch.ops.aten.clone.default(transpose_16, memory_format = torch.contiguous_format);  transpose_16 = None
    _unsafe_view_14 = torch.ops.aten._unsafe_view.default(clone_13, [4, 32, 32]);  clone_13 = None
    view_58 = torch.ops.aten.view.default(_unsafe_view_14, [128, 32]);  _unsafe_view_14 = None
    t_29 = torch.ops.aten.t.default(t_8);  t_8 = None
    mm_15 = torch.ops.aten.mm.default(view_58, t_29);  t_29 = None
    t_30 = torch.ops.aten.t.default(view_58)
    mm_16 = torch.ops.aten.mm.default(t_30, view_default);  t_30 = None
    t_31 = torch.ops.aten.t.default(mm_16);  mm_16 = None
    sum_7 = torch.ops.aten.sum.dim_IntList(view_58, [0], True);  view_58 = None
    view_59 = torch.ops.aten.view.default(sum_7, [32]);  sum_7 = None
    t_32 = torch.ops.aten.t.default(t_31);  t_31 = None
    view_60 = torch.ops.aten.view.default(mm_15, [4, 32, 64]);  mm_15 = None
    transpose_17 = torch.ops.aten.transpose.int(add_17, 1, 2);  add_17 = None
    clone_14 = torch.ops.aten.clone.default(transpose_17, memory_format = torch.contiguous_format);  transpose_17 = None
    _unsafe_view_15 = torch.ops.aten._unsafe_view.default(clone_14, [4, 32, 32]);  clone_14 = None
    view_61 = torch.ops.aten.view.default(_unsafe_view_15, [128, 32]);  _unsafe_view_15 = None
    t_33 = torch.ops.aten.t.default(t_7);  t_7 = None
    mm_17 = torch.ops.aten.mm.default(view_61, t_33);  t_33 = None
    t_34 = torch.ops.aten.t.default(view_61)
    mm_18 = torch.ops.aten.mm.default(t_34, view_default);  t_34 = None
    t_35 = torch.ops.aten.t.default(mm_18);  mm_18 = None
    sum_8 = torch.ops.aten.sum.dim_IntList(view_61, [0], True);  view_61 = None
    view_62 = torch.ops.aten.view.default(sum_8, [32]);  sum_8 = None
    t_36 = torch.ops.aten.t.default(t_35);  t_35 = None
    view_63 = torch.ops.aten.view.default(mm_17, [4, 32, 64]);  mm_17 = None
    add_20 = torch.ops.aten.add.Tensor(view_60, view_63);  view_60 = view_63 = None
    transpose_18 = torch.ops.aten.transpose.int(add_19, 1, 2);  add_19 = None
    clone_15 = torch.ops.aten.clone.default(transpose_18, memory_format = torch.contiguous_format);  transpose_18 = None
    _unsafe_view_16 = torch.ops.aten._unsafe_view.default(clone_15, [4, 32, 64]);  clone_15 = None
    view_64 = torch.ops.aten.view.default(_unsafe_view_16, [128, 64]);  _unsafe_view_16 = None
    t_37 = torch.ops.aten.t.default(t_6);  t_6 = None
    mm_19 = torch.ops.aten.mm.default(view_64, t_37);  t_37 = None
    t_38 = torch.ops.aten.t.default(view_64)
    mm_20 = torch.ops.aten.mm.default(t_38, view_default);  t_38 = view_default = None
    t_39 = torch.ops.aten.t.default(mm_20);  mm_20 = None
    sum_9 = torch.ops.aten.sum.dim_IntList(view_64, [0], True);  view_64 = None
    view_65 = torch.ops.aten.view.default(sum_9, [64]);  sum_9 = None
    t_40 = torch.ops.aten.t.default(t_39);  t_39 = None
    view_66 = torch.ops.aten.view.default(mm_19, [4, 32, 64]);  mm_19 = None
    add_21 = torch.ops.aten.add.Tensor(add_20, view_66);  add_20 = view_66 = None
    mul_42 = torch.ops.aten.mul.Tensor(add_21, mul_tensor_1);  mul_tensor_1 = None
    mul_43 = torch.ops.aten.mul.Tensor(add_21, parameter_12);  add_21 = None
    sum_10 = torch.ops.aten.sum.dim_IntList(mul_42, [0, 1], True);  mul_42 = None
    view_67 = torch.ops.aten.view.default(sum_10, [64]);  sum_10 = None
    mul_44 = torch.ops.aten.mul.Tensor(mul_43, add_5)
    mul_45 = torch.ops.aten.mul.Tensor(mul_43, rsqrt_2);  mul_43 = None
    sum_11 = torch.ops.aten.sum.dim_IntList(mul_44, [2], True);  mul_44 = None
    add_22 = torch.ops.aten.add.Tensor(add_15, mul_45);  add_15 = mul_45 = None
    pow_10 = torch.ops.aten.pow.Tensor_Scalar(rsqrt_2, 3);  rsqrt_2 = None
    mul_46 = torch.ops.aten.mul.Scalar(sum_11, -0.5);  sum_11 = None
    mul_47 = torch.ops.aten.mul.Tensor(mul_46, pow_10);  mul_46 = pow_10 = None
    expand_14 = torch.ops.aten.expand.default(mul_47, [4, 32, 64]);  mul_47 = None
    div_5 = torch.ops.aten.div.Scalar(expand_14, 64);  expand_14 = None
    pow_11 = torch.ops.aten.pow.Tensor_Scalar(add_5, 1.0);  add_5 = None
    mul_48 = torch.ops.aten.mul.Scalar(pow_11, 2.0);  pow_11 = None
    mul_49 = torch.ops.aten.mul.Tensor(div_5, mul_48);  div_5 = mul_48 = None
    add_23 = torch.ops.aten.add.Tensor(add_22, mul_49);  add_22 = mul_49 = None
    view_68 = torch.ops.aten.view.default(add_23, [128, 64])
    t_41 = torch.ops.aten.t.default(view_68)
    mul_tensor_3 = torch.ops.aten.mul.Tensor(add_3, rsqrt_1)
    mul_tensor_4 = torch.ops.aten.mul.Tensor(mul_tensor_3, parameter_9)
    view_default_7 = torch.ops.aten.view.default(mul_tensor_4, [128, 64]);  mul_tensor_4 = None
    mm_default_1 = torch.ops.aten.mm.default(view_default_7, t_4)
    _unsafe_view_default_1 = torch.ops.aten._unsafe_view.default(mm_default_1, [4, 32, 344]);  mm_default_1 = None
    split_tensor_1 = torch.ops.aten.split.Tensor(_unsafe_view_default_1, 172, -1);  _unsafe_view_default_1 = None
    getitem_8 = split_tensor_1[0]
    silu_default_1 = torch.ops.aten.silu.default(getitem_8)
    getitem_9 = split_tensor_1[1];  split_tensor_1 = None
    mul_tensor_5 = torch.ops.aten.mul.Tensor(silu_default_1, getitem_9)
    view_default_8 = torch.ops.aten.view.default(mul_tensor_5, [128, 172]);  mul_tensor_5 = None
    mm_21 = torch.ops.aten.mm.default(t_41, view_default_8);  t_41 = view_default_8 = None
    t_42 = torch.ops.aten.t.default(mm_21);  mm_21 = None
    t_43 = torch.ops.aten.t.default(t_5);  t_5 = None
    mm_22 = torch.ops.aten.mm.default(view_68, t_43);  view_68 = t_43 = None
    view_69 = torch.ops.aten.view.default(mm_22, [4, 32, 172]);  mm_22 = None
    t_44 = torch.ops.aten.t.default(t_42);  t_42 = None
    mul_50 = torch.ops.aten.mul.Tensor(view_69, silu_default_1);  silu_default_1 = None
    mul_51 = torch.ops.aten.mul.Tensor(view_69, getitem_9);  view_69 = getitem_9 = None
    silu_backward_1 = torch.ops.aten.silu_backward.default(mul_51, getitem_8);  mul_51 = getitem_8 = None
    cat_5 = torch.ops.aten.cat.default([silu_backward_1, mul_50], 2);  silu_backward_1 = mul_50 = None
    view_70 = torch.ops.aten.view.default(cat_5, [128, 344]);  cat_5 = None
    t_45 = torch.ops.aten.t.default(view_70)
    mm_23 = torch.ops.aten.mm.default(t_45, view_default_7);  t_45 = view_default_7 = None
    t_46 = torch.ops.aten.t.default(mm_23);  mm_23 = None
    t_47 = torch.ops.aten.t.default(t_4);  t_4 = None
    mm_24 = torch.ops.aten.mm.default(view_70, t_47);  view_70 = t_47 = None
    view_71 = torch.ops.aten.view.default(mm_24, [4, 32, 64]);  mm_24 = None
    t_48 = torch.ops.aten.t.default(t_46);  t_46 = None
    mul_52 = torch.ops.aten.mul.Tensor(view_71, mul_tensor_3);  mul_tensor_3 = None
    mul_53 = torch.ops.aten.mul.Tensor(view_71, parameter_9);  view_71 = None
    sum_12 = torch.ops.aten.sum.dim_IntList(mul_52, [0, 1], True);  mul_52 = None
    view_72 = torch.ops.aten.view.default(sum_12, [64]);  sum_12 = None
    mul_54 = torch.ops.aten.mul.Tensor(mul_53, add_3)
    mul_55 = torch.ops.aten.mul.Tensor(mul_53, rsqrt_1);  mul_53 = None
    sum_13 = torch.ops.aten.sum.dim_IntList(mul_54, [2], True);  mul_54 = None
    add_24 = torch.ops.aten.add.Tensor(add_23, mul_55);  add_23 = mul_55 = None
    pow_12 = torch.ops.aten.pow.Tensor_Scalar(rsqrt_1, 3);  rsqrt_1 = None
    mul_56 = torch.ops.aten.mul.Scalar(sum_13, -0.5);  sum_13 = None
    mul_57 = torch.ops.aten.mul.Tensor(mul_56, pow_12);  mul_56 = pow_12 = None
    expand_15 = torch.ops.aten.expand.default(mul_57, [4, 32, 64]);  mul_57 = None
    div_6 = torch.ops.aten.div.Scalar(expand_15, 64);  expand_15 = None
    pow_13 = torch.ops.aten.pow.Tensor_Scalar(add_3, 1.0);  add_3 = None
    mul_58 = torch.ops.aten.mul.Scalar(pow_13, 2.0);  pow_13 = None
    mul_59 = torch.ops.aten.mul.Tensor(div_6, mul_58);  div_6 = mul_58 = None
    add_25 = torch.ops.aten.add.Tensor(add_24, mul_59);  add_24 = mul_59 = None
    view_73 = torch.ops.aten.view.default(add_25, [128, 64])
    t_49 = torch.ops.aten.t.default(view_73)
    embedding_default = torch.ops.aten.embedding.default(parameter_0, input_103)
    mul_tensor_6 = torch.ops.aten.mul.Tensor(embedding_default, rsqrt)
    mul_tensor_7 = torch.ops.aten.mul.Tensor(mul_tensor_6, parameter_1)
    view_default_9 = torch.ops.aten.view.default(mul_tensor_7, [128, 64]);  mul_tensor_7 = None
    addmm_default_1 = torch.ops.aten.addmm.default(parameter_7, view_default_9, t_2)
    view_default_10 = torch.ops.aten.view.default(addmm_default_1, [4, 32, 32]);  addmm_default_1 = None
    view_default_11 = torch.ops.aten.view.default(view_default_10, [4, 32, 2, 16]);  view_default_10 = None
    transpose_int_2 = torch.ops.aten.transpose.int(view_default_11, 1, 2);  view_default_11 = None
    unsqueeze_default_1 = torch.ops.aten.unsqueeze.default(transpose_int_2, 2);  transpose_int_2 = None
    expand_default_1 = torch.ops.aten.expand.default(unsqueeze_default_1, [4, 2, 2, 32, 16]);  unsqueeze_default_1 = None
    clone_default_2 = torch.ops.aten.clone.default(expand_default_1, memory_format = torch.contiguous_format);  expand_default_1 = None
    view_default_12 = torch.ops.aten.view.default(clone_default_2, [4, 4, 32, 16]);  clone_default_2 = None
    view_default_13 = torch.ops.aten.view.default(view_default_12, [16, 32, 16]);  view_default_12 = None
    bmm_default = torch.ops.aten.bmm.default(view_13, view_default_13)
    view_default_14 = torch.ops.aten.view.default(bmm_default, [4, 4, 32, 16]);  bmm_default = None
    transpose_int_3 = torch.ops.aten.transpose.int(view_default_14, 1, 2);  view_default_14 = None
    clone_default_3 = torch.ops.aten.clone.default(transpose_int_3, memory_format = torch.contiguous_format);  transpose_int_3 = None
    _unsafe_view_default_2 = torch.ops.aten._unsafe_view.default(clone_default_3, [4, 32, 64]);  clone_default_3 = None
    view_default_15 = torch.ops.aten.view.default(_unsafe_view_default_2, [128, 64]);  _unsafe_view_default_2 = None
    mm_25 = torch.ops.aten.mm.default(t_49, view_default_15);  t_49 = view_default_15 = None
    t_50 = torch.ops.aten.t.default(mm_25);  mm_25 = None
    t_51 = torch.ops.aten.t.default(t_3);  t_3 = None
    mm_26 = torch.ops.aten.mm.default(view_73, t_51);  view_73 = t_51 = None
    view_74 = torch.ops.aten.view.default(mm_26, [4, 32, 64]);  mm_26 = None
    t_52 = torch.ops.aten.t.default(t_50);  t_50 = None
    view_75 = torch.ops.aten.view.default(view_74, [4, 32, 4, 16]);  view_74 = None
    transpose_19 = torch.ops.aten.transpose.int(view_75, 1, 2);  view_75 = None
    clone_16 = torch.ops.aten.clone.default(transpose_19, memory_format = torch.contiguous_format);  transpose_19 = None
    _unsafe_view_17 = torch.ops.aten._unsafe_view.default(clone_16, [16, 32, 16]);  clone_16 = None
    transpose_20 = torch.ops.aten.transpose.int(view_13, 1, 2);  view_13 = None
    bmm_8 = torch.ops.aten.bmm.default(transpose_20, _unsafe_view_17);  transpose_20 = None
    transpose_21 = torch.ops.aten.transpose.int(view_default_13, 1, 2);  view_default_13 = None
    bmm_9 = torch.ops.aten.bmm.default(_unsafe_view_17, transpose_21);  _unsafe_view_17 = transpose_21 = None
    view_76 = torch.ops.aten.view.default(bmm_8, [4, 4, 32, 16]);  bmm_8 = None
    view_77 = torch.ops.aten.view.default(bmm_9, [4, 4, 32, 32]);  bmm_9 = None
    _softmax_backward_data_1 = torch.ops.aten._softmax_backward_data.default(view_77, _softmax, -1, torch.float32);  view_77 = _softmax = None
    masked_fill_3 = torch.ops.aten.masked_fill.Scalar(_softmax_backward_data_1, triu, 0);  _softmax_backward_data_1 = triu = None
    div_7 = torch.ops.aten.div.Tensor(masked_fill_3, 4.0);  masked_fill_3 = None
    view_78 = torch.ops.aten.view.default(div_7, [16, 32, 32]);  div_7 = None
    transpose_22 = torch.ops.aten.transpose.int(_unsafe_view, 1, 2);  _unsafe_view = None
    bmm_10 = torch.ops.aten.bmm.default(transpose_22, view_78);  transpose_22 = None
    clone_default_4 = torch.ops.aten.clone.default(expand, memory_format = torch.contiguous_format);  expand = None
    view_default_16 = torch.ops.aten.view.default(clone_default_4, [4, 4, 32, 16]);  clone_default_4 = None
    transpose_int_4 = torch.ops.aten.transpose.int(view_default_16, -2, -1);  view_default_16 = None
    view_default_17 = torch.ops.aten.view.default(transpose_int_4, [16, 16, 32]);  transpose_int_4 = None
    transpose_23 = torch.ops.aten.transpose.int(view_default_17, 1, 2);  view_default_17 = None
    bmm_11 = torch.ops.aten.bmm.default(view_78, transpose_23);  view_78 = transpose_23 = None
    view_79 = torch.ops.aten.view.default(bmm_10, [4, 4, 16, 32]);  bmm_10 = None
    view_80 = torch.ops.aten.view.default(bmm_11, [4, 4, 32, 16]);  bmm_11 = None
    transpose_24 = torch.ops.aten.transpose.int(view_79, -2, -1);  view_79 = None
    view_81 = torch.ops.aten.view.default(view_76, [4, 2, 2, 32, 16]);  view_76 = None
    sum_14 = torch.ops.aten.sum.dim_IntList(view_81, [2], True);  view_81 = None
    squeeze_2 = torch.ops.aten.squeeze.dim(sum_14, 2);  sum_14 = None
    view_82 = torch.ops.aten.view.default(transpose_24, [4, 2, 2, 32, 16]);  transpose_24 = None
    sum_15 = torch.ops.aten.sum.dim_IntList(view_82, [2], True);  view_82 = None
    squeeze_3 = torch.ops.aten.squeeze.dim(sum_15, 2);  sum_15 = None
    mul_60 = torch.ops.aten.mul.Tensor(squeeze_3, slice_2)
    mul_61 = torch.ops.aten.mul.Tensor(squeeze_3, slice_1);  squeeze_3 = None
    slice_17 = torch.ops.aten.slice.Tensor(mul_60, 3, 0, 8)
    slice_18 = torch.ops.aten.slice.Tensor(mul_60, 3, 8, 16);  mul_60 = None
    slice_backward_5 = torch.ops.aten.slice_backward.default(slice_18, [4, 2, 32, 16], 3, 0, 8, 1);  slice_18 = None
    add_26 = torch.ops.aten.add.Tensor(mul_61, slice_backward_5);  mul_61 = slice_backward_5 = None
    neg_6 = torch.ops.aten.neg.default(slice_17);  slice_17 = None
    slice_backward_6 = torch.ops.aten.slice_backward.default(neg_6, [4, 2, 32, 16], 3, 8, 9223372036854775807, 1);  neg_6 = None
    add_27 = torch.ops.aten.add.Tensor(add_26, slice_backward_6);  add_26 = slice_backward_6 = None
    mul_62 = torch.ops.aten.mul.Tensor(view_80, slice_2);  slice_2 = None
    mul_63 = torch.ops.aten.mul.Tensor(view_80, slice_1);  view_80 = slice_1 = None
    slice_19 = torch.ops.aten.slice.Tensor(mul_62, 3, 0, 8)
    slice_20 = torch.ops.aten.slice.Tensor(mul_62, 3, 8, 16);  mul_62 = None
    slice_backward_7 = torch.ops.aten.slice_backward.default(slice_20, [4, 4, 32, 16], 3, 0, 8, 1);  slice_20 = None
    add_28 = torch.ops.aten.add.Tensor(mul_63, slice_backward_7);  mul_63 = slice_backward_7 = None
    neg_7 = torch.ops.aten.neg.default(slice_19);  slice_19 = None
    slice_backward_8 = torch.ops.aten.slice_backward.default(neg_7, [4, 4, 32, 16], 3, 8, 9223372036854775807, 1);  neg_7 = None
    add_29 = torch.ops.aten.add.Tensor(add_28, slice_backward_8);  add_28 = slice_backward_8 = None
    transpose_25 = torch.ops.aten.transpose.int(squeeze_2, 1, 2);  squeeze_2 = None
    clone_17 = torch.ops.aten.clone.default(transpose_25, memory_format = torch.contiguous_format);  transpose_25 = None
    _unsafe_view_18 = torch.ops.aten._unsafe_view.default(clone_17, [4, 32, 32]);  clone_17 = None
    view_83 = torch.ops.aten.view.default(_unsafe_view_18, [128, 32]);  _unsafe_view_18 = None
    t_53 = torch.ops.aten.t.default(t_2);  t_2 = None
    mm_27 = torch.ops.aten.mm.default(view_83, t_53);  t_53 = None
    t_54 = torch.ops.aten.t.default(view_83)
    mm_28 = torch.ops.aten.mm.default(t_54, view_default_9);  t_54 = None
    t_55 = torch.ops.aten.t.default(mm_28);  mm_28 = None
    sum_16 = torch.ops.aten.sum.dim_IntList(view_83, [0], True);  view_83 = None
    view_84 = torch.ops.aten.view.default(sum_16, [32]);  sum_16 = None
    t_56 = torch.ops.aten.t.default(t_55);  t_55 = None
    view_85 = torch.ops.aten.view.default(mm_27, [4, 32, 64]);  mm_27 = None
    transpose_26 = torch.ops.aten.transpose.int(add_27, 1, 2);  add_27 = None
    clone_18 = torch.ops.aten.clone.default(transpose_26, memory_format = torch.contiguous_format);  transpose_26 = None
    _unsafe_view_19 = torch.ops.aten._unsafe_view.default(clone_18, [4, 32, 32]);  clone_18 = None
    view_86 = torch.ops.aten.view.default(_unsafe_view_19, [128, 32]);  _unsafe_view_19 = None
    t_57 = torch.ops.aten.t.default(t_1);  t_1 = None
    mm_29 = torch.ops.aten.mm.default(view_86, t_57);  t_57 = None
    t_58 = torch.ops.aten.t.default(view_86)
    mm_30 = torch.ops.aten.mm.default(t_58, view_default_9);  t_58 = None
    t_59 = torch.ops.aten.t.default(mm_30);  mm_30 = None
    sum_17 = torch.ops.aten.sum.dim_IntList(view_86, [0], True);  view_86 = None
    view_87 = torch.ops.aten.view.default(sum_17, [32]);  sum_17 = None
    t_60 = torch.ops.aten.t.default(t_59);  t_59 = None
    view_88 = torch.ops.aten.view.default(mm_29, [4, 32, 64]);  mm_29 = None
    add_30 = torch.ops.aten.add.Tensor(view_85, view_88);  view_85 = view_88 = None
    transpose_27 = torch.ops.aten.transpose.int(add_29, 1, 2);  add_29 = None
    clone_19 = torch.ops.aten.clone.default(transpose_27, memory_format = torch.contiguous_format);  transpose_27 = None
    _unsafe_view_20 = torch.ops.aten._unsafe_view.default(clone_19, [4, 32, 64]);  clone_19 = None
    view_89 = torch.ops.aten.view.default(_unsafe_view_20, [128, 64]);  _unsafe_view_20 = None
    t_61 = torch.ops.aten.t.default(t);  t = None
    mm_31 = torch.ops.aten.mm.default(view_89, t_61);  t_61 = None
    t_62 = torch.ops.aten.t.default(view_89)
    mm_32 = torch.ops.aten.mm.default(t_62, view_default_9);  t_62 = view_default_9 = None
    t_63 = torch.ops.aten.t.default(mm_32);  mm_32 = None
    sum_18 = torch.ops.aten.sum.dim_IntList(view_89, [0], True);  view_89 = None
    view_90 = torch.ops.aten.view.default(sum_18, [64]);  sum_18 = None
    t_64 = torch.ops.aten.t.default(t_63);  t_63 = None
    view_91 = torch.ops.aten.view.default(mm_31, [4, 32, 64]);  mm_31 = None
    add_31 = torch.ops.aten.add.Tensor(add_30, view_91);  add_30 = view_91 = None
    mul_64 = torch.ops.aten.mul.Tensor(add_31, mul_tensor_6);  mul_tensor_6 = None
    mul_65 = torch.ops.aten.mul.Tensor(add_31, parameter_1);  add_31 = None
    sum_19 = torch.ops.aten.sum.dim_IntList(mul_64, [0, 1], True);  mul_64 = None
    view_92 = torch.ops.aten.view.default(sum_19, [64]);  sum_19 = None
    mul_66 = torch.ops.aten.mul.Tensor(mul_65, embedding_default)
    mul_67 = torch.ops.aten.mul.Tensor(mul_65, rsqrt);  mul_65 = None
    sum_20 = torch.ops.aten.sum.dim_IntList(mul_66, [2], True);  mul_66 = None
    add_32 = torch.ops.aten.add.Tensor(add_25, mul_67);  add_25 = mul_67 = None
    pow_14 = torch.ops.aten.pow.Tensor_Scalar(rsqrt, 3);  rsqrt = None
    mul_68 = torch.ops.aten.mul.Scalar(sum_20, -0.5);  sum_20 = None
    mul_69 = torch.ops.aten.mul.Tensor(mul_68, pow_14);  mul_68 = pow_14 = None
    expand_16 = torch.ops.aten.expand.default(mul_69, [4, 32, 64]);  mul_69 = None
    div_8 = torch.ops.aten.div.Scalar(expand_16, 64);  expand_16 = None
    pow_15 = torch.ops.aten.pow.Tensor_Scalar(embedding_default, 1.0);  embedding_default = None
    mul_70 = torch.ops.aten.mul.Scalar(pow_15, 2.0);  pow_15 = None
    mul_71 = torch.ops.aten.mul.Tensor(div_8, mul_70);  div_8 = mul_70 = None
    add_33 = torch.ops.aten.add.Tensor(add_32, mul_71);  add_32 = mul_71 = None
    embedding_dense_backward = torch.ops.aten.embedding_dense_backward.default(add_33, input_103, 256, -1, False);  add_33 = input_103 = None
    add_34 = torch.ops.aten.add.Tensor(optimizer_state_28, 1);  optimizer_state_28 = None
    mul_72 = torch.ops.aten.mul.Tensor(hyperparam_27, 0.1)
    rsub = torch.ops.aten.rsub.Scalar(mul_72, 1);  mul_72 = None
    _to_copy = torch.ops.aten._to_copy.default(rsub, dtype = torch.float32);  rsub = None
    mul_73 = torch.ops.aten.mul.Tensor(parameter_0, _to_copy);  parameter_0 = None
    lerp = torch.ops.aten.lerp.Scalar(optimizer_state_29, embedding_dense_backward, 0.09999999999999998);  optimizer_state_29 = None
    mul_74 = torch.ops.aten.mul.Tensor(optimizer_state_30, 0.999);  optimizer_state_30 = None
    addcmul = torch.ops.aten.addcmul.default(mul_74, embedding_dense_backward, embedding_dense_backward, value = 0.0010000000000000009);  mul_74 = embedding_dense_backward = None
    _to_copy_1 = torch.ops.aten._to_copy.default(add_34, dtype = torch.float64)
    pow_16 = torch.ops.aten.pow.Scalar(0.9, _to_copy_1)
    rsub_1 = torch.ops.aten.rsub.Scalar(pow_16, 1);  pow_16 = None
    pow_17 = torch.ops.aten.pow.Scalar(0.999, _to_copy_1);  _to_copy_1 = None
    rsub_2 = torch.ops.aten.rsub.Scalar(pow_17, 1);  pow_17 = None
    sqrt = torch.ops.aten.sqrt.default(rsub_2);  rsub_2 = None
    sqrt_1 = torch.ops.aten.sqrt.default(addcmul)
    _to_copy_2 = torch.ops.aten._to_copy.default(sqrt, dtype = torch.float32);  sqrt = None
    div_9 = torch.ops.aten.div.Tensor(sqrt_1, _to_copy_2);  sqrt_1 = _to_copy_2 = None
    add_35 = torch.ops.aten.add.Tensor(div_9, 1e-08);  div_9 = None
    div_10 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_1);  rsub_1 = None
    _to_copy_3 = torch.ops.aten._to_copy.default(div_10, dtype = torch.float32);  div_10 = None
    neg_8 = torch.ops.aten.neg.default(_to_copy_3);  _to_copy_3 = None
    div_11 = torch.ops.aten.div.Tensor(lerp, add_35);  add_35 = None
    mul_75 = torch.ops.aten.mul.Tensor(neg_8, div_11);  neg_8 = div_11 = None
    add_36 = torch.ops.aten.add.Tensor(mul_73, mul_75);  mul_73 = mul_75 = None
    add_37 = torch.ops.aten.add.Tensor(optimizer_state_31, 1);  optimizer_state_31 = None
    mul_77 = torch.ops.aten.mul.Tensor(parameter_1, _to_copy);  parameter_1 = None
    lerp_1 = torch.ops.aten.lerp.Scalar(optimizer_state_32, view_92, 0.09999999999999998);  optimizer_state_32 = None
    mul_78 = torch.ops.aten.mul.Tensor(optimizer_state_33, 0.999);  optimizer_state_33 = None
    addcmul_1 = torch.ops.aten.addcmul.default(mul_78, view_92, view_92, value = 0.0010000000000000009);  mul_78 = view_92 = None
    _to_copy_5 = torch.ops.aten._to_copy.default(add_37, dtype = torch.float64)
    pow_18 = torch.ops.aten.pow.Scalar(0.9, _to_copy_5)
    rsub_4 = torch.ops.aten.rsub.Scalar(pow_18, 1);  pow_18 = None
    pow_19 = torch.ops.aten.pow.Scalar(0.999, _to_copy_5);  _to_copy_5 = None
    rsub_5 = torch.ops.aten.rsub.Scalar(pow_19, 1);  pow_19 = None
    sqrt_2 = torch.ops.aten.sqrt.default(rsub_5);  rsub_5 = None
    sqrt_3 = torch.ops.aten.sqrt.default(addcmul_1)
    _to_copy_6 = torch.ops.aten._to_copy.default(sqrt_2, dtype = torch.float32);  sqrt_2 = None
    div_12 = torch.ops.aten.div.Tensor(sqrt_3, _to_copy_6);  sqrt_3 = _to_copy_6 = None
    add_38 = torch.ops.aten.add.Tensor(div_12, 1e-08);  div_12 = None
    div_13 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_4);  rsub_4 = None
    _to_copy_7 = torch.ops.aten._to_copy.default(div_13, dtype = torch.float32);  div_13 = None
    neg_9 = torch.ops.aten.neg.default(_to_copy_7);  _to_copy_7 = None
    div_14 = torch.ops.aten.div.Tensor(lerp_1, add_38);  add_38 = None
    mul_79 = torch.ops.aten.mul.Tensor(neg_9, div_14);  neg_9 = div_14 = None
    add_39 = torch.ops.aten.add.Tensor(mul_77, mul_79);  mul_77 = mul_79 = None
    add_40 = torch.ops.aten.add.Tensor(optimizer_state_34, 1);  optimizer_state_34 = None
    mul_81 = torch.ops.aten.mul.Tensor(parameter_2, _to_copy);  parameter_2 = None
    lerp_2 = torch.ops.aten.lerp.Scalar(optimizer_state_35, t_64, 0.09999999999999998);  optimizer_state_35 = None
    mul_82 = torch.ops.aten.mul.Tensor(optimizer_state_36, 0.999);  optimizer_state_36 = None
    addcmul_2 = torch.ops.aten.addcmul.default(mul_82, t_64, t_64, value = 0.0010000000000000009);  mul_82 = t_64 = None
    _to_copy_9 = torch.ops.aten._to_copy.default(add_40, dtype = torch.float64)
    pow_20 = torch.ops.aten.pow.Scalar(0.9, _to_copy_9)
    rsub_7 = torch.ops.aten.rsub.Scalar(pow_20, 1);  pow_20 = None
    pow_21 = torch.ops.aten.pow.Scalar(0.999, _to_copy_9);  _to_copy_9 = None
    rsub_8 = torch.ops.aten.rsub.Scalar(pow_21, 1);  pow_21 = None
    sqrt_4 = torch.ops.aten.sqrt.default(rsub_8);  rsub_8 = None
    sqrt_5 = torch.ops.aten.sqrt.default(addcmul_2)
    _to_copy_10 = torch.ops.aten._to_copy.default(sqrt_4, dtype = torch.float32);  sqrt_4 = None
    div_15 = torch.ops.aten.div.Tensor(sqrt_5, _to_copy_10);  sqrt_5 = _to_copy_10 = None
    add_41 = torch.ops.aten.add.Tensor(div_15, 1e-08);  div_15 = None
    div_16 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_7);  rsub_7 = None
    _to_copy_11 = torch.ops.aten._to_copy.default(div_16, dtype = torch.float32);  div_16 = None
    neg_10 = torch.ops.aten.neg.default(_to_copy_11);  _to_copy_11 = None
    div_17 = torch.ops.aten.div.Tensor(lerp_2, add_41);  add_41 = None
    mul_83 = torch.ops.aten.mul.Tensor(neg_10, div_17);  neg_10 = div_17 = None
    add_42 = torch.ops.aten.add.Tensor(mul_81, mul_83);  mul_81 = mul_83 = None
    add_43 = torch.ops.aten.add.Tensor(optimizer_state_37, 1);  optimizer_state_37 = None
    mul_85 = torch.ops.aten.mul.Tensor(parameter_3, _to_copy);  parameter_3 = None
    lerp_3 = torch.ops.aten.lerp.Scalar(optimizer_state_38, view_90, 0.09999999999999998);  optimizer_state_38 = None
    mul_86 = torch.ops.aten.mul.Tensor(optimizer_state_39, 0.999);  optimizer_state_39 = None
    addcmul_3 = torch.ops.aten.addcmul.default(mul_86, view_90, view_90, value = 0.0010000000000000009);  mul_86 = view_90 = None
    _to_copy_13 = torch.ops.aten._to_copy.default(add_43, dtype = torch.float64)
    pow_22 = torch.ops.aten.pow.Scalar(0.9, _to_copy_13)
    rsub_10 = torch.ops.aten.rsub.Scalar(pow_22, 1);  pow_22 = None
    pow_23 = torch.ops.aten.pow.Scalar(0.999, _to_copy_13);  _to_copy_13 = None
    rsub_11 = torch.ops.aten.rsub.Scalar(pow_23, 1);  pow_23 = None
    sqrt_6 = torch.ops.aten.sqrt.default(rsub_11);  rsub_11 = None
    sqrt_7 = torch.ops.aten.sqrt.default(addcmul_3)
    _to_copy_14 = torch.ops.aten._to_copy.default(sqrt_6, dtype = torch.float32);  sqrt_6 = None
    div_18 = torch.ops.aten.div.Tensor(sqrt_7, _to_copy_14);  sqrt_7 = _to_copy_14 = None
    add_44 = torch.ops.aten.add.Tensor(div_18, 1e-08);  div_18 = None
    div_19 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_10);  rsub_10 = None
    _to_copy_15 = torch.ops.aten._to_copy.default(div_19, dtype = torch.float32);  div_19 = None
    neg_11 = torch.ops.aten.neg.default(_to_copy_15);  _to_copy_15 = None
    div_20 = torch.ops.aten.div.Tensor(lerp_3, add_44);  add_44 = None
    mul_87 = torch.ops.aten.mul.Tensor(neg_11, div_20);  neg_11 = div_20 = None
    add_45 = torch.ops.aten.add.Tensor(mul_85, mul_87);  mul_85 = mul_87 = None
    add_46 = torch.ops.aten.add.Tensor(optimizer_state_40, 1);  optimizer_state_40 = None
    mul_89 = torch.ops.aten.mul.Tensor(parameter_4, _to_copy);  parameter_4 = None
    lerp_4 = torch.ops.aten.lerp.Scalar(optimizer_state_41, t_60, 0.09999999999999998);  optimizer_state_41 = None
    mul_90 = torch.ops.aten.mul.Tensor(optimizer_state_42, 0.999);  optimizer_state_42 = None
    addcmul_4 = torch.ops.aten.addcmul.default(mul_90, t_60, t_60, value = 0.0010000000000000009);  mul_90 = t_60 = None
    _to_copy_17 = torch.ops.aten._to_copy.default(add_46, dtype = torch.float64)
    pow_24 = torch.ops.aten.pow.Scalar(0.9, _to_copy_17)
    rsub_13 = torch.ops.aten.rsub.Scalar(pow_24, 1);  pow_24 = None
    pow_25 = torch.ops.aten.pow.Scalar(0.999, _to_copy_17);  _to_copy_17 = None
    rsub_14 = torch.ops.aten.rsub.Scalar(pow_25, 1);  pow_25 = None
    sqrt_8 = torch.ops.aten.sqrt.default(rsub_14);  rsub_14 = None
    sqrt_9 = torch.ops.aten.sqrt.default(addcmul_4)
    _to_copy_18 = torch.ops.aten._to_copy.default(sqrt_8, dtype = torch.float32);  sqrt_8 = None
    div_21 = torch.ops.aten.div.Tensor(sqrt_9, _to_copy_18);  sqrt_9 = _to_copy_18 = None
    add_47 = torch.ops.aten.add.Tensor(div_21, 1e-08);  div_21 = None
    div_22 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_13);  rsub_13 = None
    _to_copy_19 = torch.ops.aten._to_copy.default(div_22, dtype = torch.float32);  div_22 = None
    neg_12 = torch.ops.aten.neg.default(_to_copy_19);  _to_copy_19 = None
    div_23 = torch.ops.aten.div.Tensor(lerp_4, add_47);  add_47 = None
    mul_91 = torch.ops.aten.mul.Tensor(neg_12, div_23);  neg_12 = div_23 = None
    add_48 = torch.ops.aten.add.Tensor(mul_89, mul_91);  mul_89 = mul_91 = None
    add_49 = torch.ops.aten.add.Tensor(optimizer_state_43, 1);  optimizer_state_43 = None
    mul_93 = torch.ops.aten.mul.Tensor(parameter_5, _to_copy);  parameter_5 = None
    lerp_5 = torch.ops.aten.lerp.Scalar(optimizer_state_44, view_87, 0.09999999999999998);  optimizer_state_44 = None
    mul_94 = torch.ops.aten.mul.Tensor(optimizer_state_45, 0.999);  optimizer_state_45 = None
    addcmul_5 = torch.ops.aten.addcmul.default(mul_94, view_87, view_87, value = 0.0010000000000000009);  mul_94 = view_87 = None
    _to_copy_21 = torch.ops.aten._to_copy.default(add_49, dtype = torch.float64)
    pow_26 = torch.ops.aten.pow.Scalar(0.9, _to_copy_21)
    rsub_16 = torch.ops.aten.rsub.Scalar(pow_26, 1);  pow_26 = None
    pow_27 = torch.ops.aten.pow.Scalar(0.999, _to_copy_21);  _to_copy_21 = None
    rsub_17 = torch.ops.aten.rsub.Scalar(pow_27, 1);  pow_27 = None
    sqrt_10 = torch.ops.aten.sqrt.default(rsub_17);  rsub_17 = None
    sqrt_11 = torch.ops.aten.sqrt.default(addcmul_5)
    _to_copy_22 = torch.ops.aten._to_copy.default(sqrt_10, dtype = torch.float32);  sqrt_10 = None
    div_24 = torch.ops.aten.div.Tensor(sqrt_11, _to_copy_22);  sqrt_11 = _to_copy_22 = None
    add_50 = torch.ops.aten.add.Tensor(div_24, 1e-08);  div_24 = None
    div_25 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_16);  rsub_16 = None
    _to_copy_23 = torch.ops.aten._to_copy.default(div_25, dtype = torch.float32);  div_25 = None
    neg_13 = torch.ops.aten.neg.default(_to_copy_23);  _to_copy_23 = None
    div_26 = torch.ops.aten.div.Tensor(lerp_5, add_50);  add_50 = None
    mul_95 = torch.ops.aten.mul.Tensor(neg_13, div_26);  neg_13 = div_26 = None
    add_51 = torch.ops.aten.add.Tensor(mul_93, mul_95);  mul_93 = mul_95 = None
    add_52 = torch.ops.aten.add.Tensor(optimizer_state_46, 1);  optimizer_state_46 = None
    mul_97 = torch.ops.aten.mul.Tensor(parameter_6, _to_copy);  parameter_6 = None
    lerp_6 = torch.ops.aten.lerp.Scalar(optimizer_state_47, t_56, 0.09999999999999998);  optimizer_state_47 = None
    mul_98 = torch.ops.aten.mul.Tensor(optimizer_state_48, 0.999);  optimizer_state_48 = None
    addcmul_6 = torch.ops.aten.addcmul.default(mul_98, t_56, t_56, value = 0.0010000000000000009);  mul_98 = t_56 = None
    _to_copy_25 = torch.ops.aten._to_copy.default(add_52, dtype = torch.float64)
    pow_28 = torch.ops.aten.pow.Scalar(0.9, _to_copy_25)
    rsub_19 = torch.ops.aten.rsub.Scalar(pow_28, 1);  pow_28 = None
    pow_29 = torch.ops.aten.pow.Scalar(0.999, _to_copy_25);  _to_copy_25 = None
    rsub_20 = torch.ops.aten.rsub.Scalar(pow_29, 1);  pow_29 = None
    sqrt_12 = torch.ops.aten.sqrt.default(rsub_20);  rsub_20 = None
    sqrt_13 = torch.ops.aten.sqrt.default(addcmul_6)
    _to_copy_26 = torch.ops.aten._to_copy.default(sqrt_12, dtype = torch.float32);  sqrt_12 = None
    div_27 = torch.ops.aten.div.Tensor(sqrt_13, _to_copy_26);  sqrt_13 = _to_copy_26 = None
    add_53 = torch.ops.aten.add.Tensor(div_27, 1e-08);  div_27 = None
    div_28 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_19);  rsub_19 = None
    _to_copy_27 = torch.ops.aten._to_copy.default(div_28, dtype = torch.float32);  div_28 = None
    neg_14 = torch.ops.aten.neg.default(_to_copy_27);  _to_copy_27 = None
    div_29 = torch.ops.aten.div.Tensor(lerp_6, add_53);  add_53 = None
    mul_99 = torch.ops.aten.mul.Tensor(neg_14, div_29);  neg_14 = div_29 = None
    add_54 = torch.ops.aten.add.Tensor(mul_97, mul_99);  mul_97 = mul_99 = None
    add_55 = torch.ops.aten.add.Tensor(optimizer_state_49, 1);  optimizer_state_49 = None
    mul_101 = torch.ops.aten.mul.Tensor(parameter_7, _to_copy);  parameter_7 = None
    lerp_7 = torch.ops.aten.lerp.Scalar(optimizer_state_50, view_84, 0.09999999999999998);  optimizer_state_50 = None
    mul_102 = torch.ops.aten.mul.Tensor(optimizer_state_51, 0.999);  optimizer_state_51 = None
    addcmul_7 = torch.ops.aten.addcmul.default(mul_102, view_84, view_84, value = 0.0010000000000000009);  mul_102 = view_84 = None
    _to_copy_29 = torch.ops.aten._to_copy.default(add_55, dtype = torch.float64)
    pow_30 = torch.ops.aten.pow.Scalar(0.9, _to_copy_29)
    rsub_22 = torch.ops.aten.rsub.Scalar(pow_30, 1);  pow_30 = None
    pow_31 = torch.ops.aten.pow.Scalar(0.999, _to_copy_29);  _to_copy_29 = None
    rsub_23 = torch.ops.aten.rsub.Scalar(pow_31, 1);  pow_31 = None
    sqrt_14 = torch.ops.aten.sqrt.default(rsub_23);  rsub_23 = None
    sqrt_15 = torch.ops.aten.sqrt.default(addcmul_7)
    _to_copy_30 = torch.ops.aten._to_copy.default(sqrt_14, dtype = torch.float32);  sqrt_14 = None
    div_30 = torch.ops.aten.div.Tensor(sqrt_15, _to_copy_30);  sqrt_15 = _to_copy_30 = None
    add_56 = torch.ops.aten.add.Tensor(div_30, 1e-08);  div_30 = None
    div_31 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_22);  rsub_22 = None
    _to_copy_31 = torch.ops.aten._to_copy.default(div_31, dtype = torch.float32);  div_31 = None
    neg_15 = torch.ops.aten.neg.default(_to_copy_31);  _to_copy_31 = None
    div_32 = torch.ops.aten.div.Tensor(lerp_7, add_56);  add_56 = None
    mul_103 = torch.ops.aten.mul.Tensor(neg_15, div_32);  neg_15 = div_32 = None
    add_57 = torch.ops.aten.add.Tensor(mul_101, mul_103);  mul_101 = mul_103 = None
    add_58 = torch.ops.aten.add.Tensor(optimizer_state_52, 1);  optimizer_state_52 = None
    mul_105 = torch.ops.aten.mul.Tensor(parameter_8, _to_copy);  parameter_8 = None
    lerp_8 = torch.ops.aten.lerp.Scalar(optimizer_state_53, t_52, 0.09999999999999998);  optimizer_state_53 = None
    mul_106 = torch.ops.aten.mul.Tensor(optimizer_state_54, 0.999);  optimizer_state_54 = None
    addcmul_8 = torch.ops.aten.addcmul.default(mul_106, t_52, t_52, value = 0.0010000000000000009);  mul_106 = t_52 = None
    _to_copy_33 = torch.ops.aten._to_copy.default(add_58, dtype = torch.float64)
    pow_32 = torch.ops.aten.pow.Scalar(0.9, _to_copy_33)
    rsub_25 = torch.ops.aten.rsub.Scalar(pow_32, 1);  pow_32 = None
    pow_33 = torch.ops.aten.pow.Scalar(0.999, _to_copy_33);  _to_copy_33 = None
    rsub_26 = torch.ops.aten.rsub.Scalar(pow_33, 1);  pow_33 = None
    sqrt_16 = torch.ops.aten.sqrt.default(rsub_26);  rsub_26 = None
    sqrt_17 = torch.ops.aten.sqrt.default(addcmul_8)
    _to_copy_34 = torch.ops.aten._to_copy.default(sqrt_16, dtype = torch.float32);  sqrt_16 = None
    div_33 = torch.ops.aten.div.Tensor(sqrt_17, _to_copy_34);  sqrt_17 = _to_copy_34 = None
    add_59 = torch.ops.aten.add.Tensor(div_33, 1e-08);  div_33 = None
    div_34 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_25);  rsub_25 = None
    _to_copy_35 = torch.ops.aten._to_copy.default(div_34, dtype = torch.float32);  div_34 = None
    neg_16 = torch.ops.aten.neg.default(_to_copy_35);  _to_copy_35 = None
    div_35 = torch.ops.aten.div.Tensor(lerp_8, add_59);  add_59 = None
    mul_107 = torch.ops.aten.mul.Tensor(neg_16, div_35);  neg_16 = div_35 = None
    add_60 = torch.ops.aten.add.Tensor(mul_105, mul_107);  mul_105 = mul_107 = None
    add_61 = torch.ops.aten.add.Tensor(optimizer_state_55, 1);  optimizer_state_55 = None
    mul_109 = torch.ops.aten.mul.Tensor(parameter_9, _to_copy);  parameter_9 = None
    lerp_9 = torch.ops.aten.lerp.Scalar(optimizer_state_56, view_72, 0.09999999999999998);  optimizer_state_56 = None
    mul_110 = torch.ops.aten.mul.Tensor(optimizer_state_57, 0.999);  optimizer_state_57 = None
    addcmul_9 = torch.ops.aten.addcmul.default(mul_110, view_72, view_72, value = 0.0010000000000000009);  mul_110 = view_72 = None
    _to_copy_37 = torch.ops.aten._to_copy.default(add_61, dtype = torch.float64)
    pow_34 = torch.ops.aten.pow.Scalar(0.9, _to_copy_37)
    rsub_28 = torch.ops.aten.rsub.Scalar(pow_34, 1);  pow_34 = None
    pow_35 = torch.ops.aten.pow.Scalar(0.999, _to_copy_37);  _to_copy_37 = None
    rsub_29 = torch.ops.aten.rsub.Scalar(pow_35, 1);  pow_35 = None
    sqrt_18 = torch.ops.aten.sqrt.default(rsub_29);  rsub_29 = None
    sqrt_19 = torch.ops.aten.sqrt.default(addcmul_9)
    _to_copy_38 = torch.ops.aten._to_copy.default(sqrt_18, dtype = torch.float32);  sqrt_18 = None
    div_36 = torch.ops.aten.div.Tensor(sqrt_19, _to_copy_38);  sqrt_19 = _to_copy_38 = None
    add_62 = torch.ops.aten.add.Tensor(div_36, 1e-08);  div_36 = None
    div_37 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_28);  rsub_28 = None
    _to_copy_39 = torch.ops.aten._to_copy.default(div_37, dtype = torch.float32);  div_37 = None
    neg_17 = torch.ops.aten.neg.default(_to_copy_39);  _to_copy_39 = None
    div_38 = torch.ops.aten.div.Tensor(lerp_9, add_62);  add_62 = None
    mul_111 = torch.ops.aten.mul.Tensor(neg_17, div_38);  neg_17 = div_38 = None
    add_63 = torch.ops.aten.add.Tensor(mul_109, mul_111);  mul_109 = mul_111 = None
    add_64 = torch.ops.aten.add.Tensor(optimizer_state_58, 1);  optimizer_state_58 = None
    mul_113 = torch.ops.aten.mul.Tensor(parameter_10, _to_copy);  parameter_10 = None
    lerp_10 = torch.ops.aten.lerp.Scalar(optimizer_state_59, t_48, 0.09999999999999998);  optimizer_state_59 = None
    mul_114 = torch.ops.aten.mul.Tensor(optimizer_state_60, 0.999);  optimizer_state_60 = None
    addcmul_10 = torch.ops.aten.addcmul.default(mul_114, t_48, t_48, value = 0.0010000000000000009);  mul_114 = t_48 = None
    _to_copy_41 = torch.ops.aten._to_copy.default(add_64, dtype = torch.float64)
    pow_36 = torch.ops.aten.pow.Scalar(0.9, _to_copy_41)
    rsub_31 = torch.ops.aten.rsub.Scalar(pow_36, 1);  pow_36 = None
    pow_37 = torch.ops.aten.pow.Scalar(0.999, _to_copy_41);  _to_copy_41 = None
    rsub_32 = torch.ops.aten.rsub.Scalar(pow_37, 1);  pow_37 = None
    sqrt_20 = torch.ops.aten.sqrt.default(rsub_32);  rsub_32 = None
    sqrt_21 = torch.ops.aten.sqrt.default(addcmul_10)
    _to_copy_42 = torch.ops.aten._to_copy.default(sqrt_20, dtype = torch.float32);  sqrt_20 = None
    div_39 = torch.ops.aten.div.Tensor(sqrt_21, _to_copy_42);  sqrt_21 = _to_copy_42 = None
    add_65 = torch.ops.aten.add.Tensor(div_39, 1e-08);  div_39 = None
    div_40 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_31);  rsub_31 = None
    _to_copy_43 = torch.ops.aten._to_copy.default(div_40, dtype = torch.float32);  div_40 = None
    neg_18 = torch.ops.aten.neg.default(_to_copy_43);  _to_copy_43 = None
    div_41 = torch.ops.aten.div.Tensor(lerp_10, add_65);  add_65 = None
    mul_115 = torch.ops.aten.mul.Tensor(neg_18, div_41);  neg_18 = div_41 = None
    add_66 = torch.ops.aten.add.Tensor(mul_113, mul_115);  mul_113 = mul_115 = None
    add_67 = torch.ops.aten.add.Tensor(optimizer_state_61, 1);  optimizer_state_61 = None
    mul_117 = torch.ops.aten.mul.Tensor(parameter_11, _to_copy);  parameter_11 = None
    lerp_11 = torch.ops.aten.lerp.Scalar(optimizer_state_62, t_44, 0.09999999999999998);  optimizer_state_62 = None
    mul_118 = torch.ops.aten.mul.Tensor(optimizer_state_63, 0.999);  optimizer_state_63 = None
    addcmul_11 = torch.ops.aten.addcmul.default(mul_118, t_44, t_44, value = 0.0010000000000000009);  mul_118 = t_44 = None
    _to_copy_45 = torch.ops.aten._to_copy.default(add_67, dtype = torch.float64)
    pow_38 = torch.ops.aten.pow.Scalar(0.9, _to_copy_45)
    rsub_34 = torch.ops.aten.rsub.Scalar(pow_38, 1);  pow_38 = None
    pow_39 = torch.ops.aten.pow.Scalar(0.999, _to_copy_45);  _to_copy_45 = None
    rsub_35 = torch.ops.aten.rsub.Scalar(pow_39, 1);  pow_39 = None
    sqrt_22 = torch.ops.aten.sqrt.default(rsub_35);  rsub_35 = None
    sqrt_23 = torch.ops.aten.sqrt.default(addcmul_11)
    _to_copy_46 = torch.ops.aten._to_copy.default(sqrt_22, dtype = torch.float32);  sqrt_22 = None
    div_42 = torch.ops.aten.div.Tensor(sqrt_23, _to_copy_46);  sqrt_23 = _to_copy_46 = None
    add_68 = torch.ops.aten.add.Tensor(div_42, 1e-08);  div_42 = None
    div_43 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_34);  rsub_34 = None
    _to_copy_47 = torch.ops.aten._to_copy.default(div_43, dtype = torch.float32);  div_43 = None
    neg_19 = torch.ops.aten.neg.default(_to_copy_47);  _to_copy_47 = None
    div_44 = torch.ops.aten.div.Tensor(lerp_11, add_68);  add_68 = None
    mul_119 = torch.ops.aten.mul.Tensor(neg_19, div_44);  neg_19 = div_44 = None
    add_69 = torch.ops.aten.add.Tensor(mul_117, mul_119);  mul_117 = mul_119 = None
    add_70 = torch.ops.aten.add.Tensor(optimizer_state_64, 1);  optimizer_state_64 = None
    mul_121 = torch.ops.aten.mul.Tensor(parameter_12, _to_copy);  parameter_12 = None
    lerp_12 = torch.ops.aten.lerp.Scalar(optimizer_state_65, view_67, 0.09999999999999998);  optimizer_state_65 = None
    mul_122 = torch.ops.aten.mul.Tensor(optimizer_state_66, 0.999);  optimizer_state_66 = None
    addcmul_12 = torch.ops.aten.addcmul.default(mul_122, view_67, view_67, value = 0.0010000000000000009);  mul_122 = view_67 = None
    _to_copy_49 = torch.ops.aten._to_copy.default(add_70, dtype = torch.float64)
    pow_40 = torch.ops.aten.pow.Scalar(0.9, _to_copy_49)
    rsub_37 = torch.ops.aten.rsub.Scalar(pow_40, 1);  pow_40 = None
    pow_41 = torch.ops.aten.pow.Scalar(0.999, _to_copy_49);  _to_copy_49 = None
    rsub_38 = torch.ops.aten.rsub.Scalar(pow_41, 1);  pow_41 = None
    sqrt_24 = torch.ops.aten.sqrt.default(rsub_38);  rsub_38 = None
    sqrt_25 = torch.ops.aten.sqrt.default(addcmul_12)
    _to_copy_50 = torch.ops.aten._to_copy.default(sqrt_24, dtype = torch.float32);  sqrt_24 = None
    div_45 = torch.ops.aten.div.Tensor(sqrt_25, _to_copy_50);  sqrt_25 = _to_copy_50 = None
    add_71 = torch.ops.aten.add.Tensor(div_45, 1e-08);  div_45 = None
    div_46 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_37);  rsub_37 = None
    _to_copy_51 = torch.ops.aten._to_copy.default(div_46, dtype = torch.float32);  div_46 = None
    neg_20 = torch.ops.aten.neg.default(_to_copy_51);  _to_copy_51 = None
    div_47 = torch.ops.aten.div.Tensor(lerp_12, add_71);  add_71 = None
    mul_123 = torch.ops.aten.mul.Tensor(neg_20, div_47);  neg_20 = div_47 = None
    add_72 = torch.ops.aten.add.Tensor(mul_121, mul_123);  mul_121 = mul_123 = None
    add_73 = torch.ops.aten.add.Tensor(optimizer_state_67, 1);  optimizer_state_67 = None
    mul_125 = torch.ops.aten.mul.Tensor(parameter_13, _to_copy);  parameter_13 = None
    lerp_13 = torch.ops.aten.lerp.Scalar(optimizer_state_68, t_40, 0.09999999999999998);  optimizer_state_68 = None
    mul_126 = torch.ops.aten.mul.Tensor(optimizer_state_69, 0.999);  optimizer_state_69 = None
    addcmul_13 = torch.ops.aten.addcmul.default(mul_126, t_40, t_40, value = 0.0010000000000000009);  mul_126 = t_40 = None
    _to_copy_53 = torch.ops.aten._to_copy.default(add_73, dtype = torch.float64)
    pow_42 = torch.ops.aten.pow.Scalar(0.9, _to_copy_53)
    rsub_40 = torch.ops.aten.rsub.Scalar(pow_42, 1);  pow_42 = None
    pow_43 = torch.ops.aten.pow.Scalar(0.999, _to_copy_53);  _to_copy_53 = None
    rsub_41 = torch.ops.aten.rsub.Scalar(pow_43, 1);  pow_43 = None
    sqrt_26 = torch.ops.aten.sqrt.default(rsub_41);  rsub_41 = None
    sqrt_27 = torch.ops.aten.sqrt.default(addcmul_13)
    _to_copy_54 = torch.ops.aten._to_copy.default(sqrt_26, dtype = torch.float32);  sqrt_26 = None
    div_48 = torch.ops.aten.div.Tensor(sqrt_27, _to_copy_54);  sqrt_27 = _to_copy_54 = None
    add_74 = torch.ops.aten.add.Tensor(div_48, 1e-08);  div_48 = None
    div_49 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_40);  rsub_40 = None
    _to_copy_55 = torch.ops.aten._to_copy.default(div_49, dtype = torch.float32);  div_49 = None
    neg_21 = torch.ops.aten.neg.default(_to_copy_55);  _to_copy_55 = None
    div_50 = torch.ops.aten.div.Tensor(lerp_13, add_74);  add_74 = None
    mul_127 = torch.ops.aten.mul.Tensor(neg_21, div_50);  neg_21 = div_50 = None
    add_75 = torch.ops.aten.add.Tensor(mul_125, mul_127);  mul_125 = mul_127 = None
    add_76 = torch.ops.aten.add.Tensor(optimizer_state_70, 1);  optimizer_state_70 = None
    mul_129 = torch.ops.aten.mul.Tensor(parameter_14, _to_copy);  parameter_14 = None
    lerp_14 = torch.ops.aten.lerp.Scalar(optimizer_state_71, view_65, 0.09999999999999998);  optimizer_state_71 = None
    mul_130 = torch.ops.aten.mul.Tensor(optimizer_state_72, 0.999);  optimizer_state_72 = None
    addcmul_14 = torch.ops.aten.addcmul.default(mul_130, view_65, view_65, value = 0.0010000000000000009);  mul_130 = view_65 = None
    _to_copy_57 = torch.ops.aten._to_copy.default(add_76, dtype = torch.float64)
    pow_44 = torch.ops.aten.pow.Scalar(0.9, _to_copy_57)
    rsub_43 = torch.ops.aten.rsub.Scalar(pow_44, 1);  pow_44 = None
    pow_45 = torch.ops.aten.pow.Scalar(0.999, _to_copy_57);  _to_copy_57 = None
    rsub_44 = torch.ops.aten.rsub.Scalar(pow_45, 1);  pow_45 = None
    sqrt_28 = torch.ops.aten.sqrt.default(rsub_44);  rsub_44 = None
    sqrt_29 = torch.ops.aten.sqrt.default(addcmul_14)
    _to_copy_58 = torch.ops.aten._to_copy.default(sqrt_28, dtype = torch.float32);  sqrt_28 = None
    div_51 = torch.ops.aten.div.Tensor(sqrt_29, _to_copy_58);  sqrt_29 = _to_copy_58 = None
    add_77 = torch.ops.aten.add.Tensor(div_51, 1e-08);  div_51 = None
    div_52 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_43);  rsub_43 = None
    _to_copy_59 = torch.ops.aten._to_copy.default(div_52, dtype = torch.float32);  div_52 = None
    neg_22 = torch.ops.aten.neg.default(_to_copy_59);  _to_copy_59 = None
    div_53 = torch.ops.aten.div.Tensor(lerp_14, add_77);  add_77 = None
    mul_131 = torch.ops.aten.mul.Tensor(neg_22, div_53);  neg_22 = div_53 = None
    add_78 = torch.ops.aten.add.Tensor(mul_129, mul_131);  mul_129 = mul_131 = None
    add_79 = torch.ops.aten.add.Tensor(optimizer_state_73, 1);  optimizer_state_73 = None
    mul_133 = torch.ops.aten.mul.Tensor(parameter_15, _to_copy);  parameter_15 = None
    lerp_15 = torch.ops.aten.lerp.Scalar(optimizer_state_74, t_36, 0.09999999999999998);  optimizer_state_74 = None
    mul_134 = torch.ops.aten.mul.Tensor(optimizer_state_75, 0.999);  optimizer_state_75 = None
    addcmul_15 = torch.ops.aten.addcmul.default(mul_134, t_36, t_36, value = 0.0010000000000000009);  mul_134 = t_36 = None
    _to_copy_61 = torch.ops.aten._to_copy.default(add_79, dtype = torch.float64)
    pow_46 = torch.ops.aten.pow.Scalar(0.9, _to_copy_61)
    rsub_46 = torch.ops.aten.rsub.Scalar(pow_46, 1);  pow_46 = None
    pow_47 = torch.ops.aten.pow.Scalar(0.999, _to_copy_61);  _to_copy_61 = None
    rsub_47 = torch.ops.aten.rsub.Scalar(pow_47, 1);  pow_47 = None
    sqrt_30 = torch.ops.aten.sqrt.default(rsub_47);  rsub_47 = None
    sqrt_31 = torch.ops.aten.sqrt.default(addcmul_15)
    _to_copy_62 = torch.ops.aten._to_copy.default(sqrt_30, dtype = torch.float32);  sqrt_30 = None
    div_54 = torch.ops.aten.div.Tensor(sqrt_31, _to_copy_62);  sqrt_31 = _to_copy_62 = None
    add_80 = torch.ops.aten.add.Tensor(div_54, 1e-08);  div_54 = None
    div_55 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_46);  rsub_46 = None
    _to_copy_63 = torch.ops.aten._to_copy.default(div_55, dtype = torch.float32);  div_55 = None
    neg_23 = torch.ops.aten.neg.default(_to_copy_63);  _to_copy_63 = None
    div_56 = torch.ops.aten.div.Tensor(lerp_15, add_80);  add_80 = None
    mul_135 = torch.ops.aten.mul.Tensor(neg_23, div_56);  neg_23 = div_56 = None
    add_81 = torch.ops.aten.add.Tensor(mul_133, mul_135);  mul_133 = mul_135 = None
    add_82 = torch.ops.aten.add.Tensor(optimizer_state_76, 1);  optimizer_state_76 = None
    mul_137 = torch.ops.aten.mul.Tensor(parameter_16, _to_copy);  parameter_16 = None
    lerp_16 = torch.ops.aten.lerp.Scalar(optimizer_state_77, view_62, 0.09999999999999998);  optimizer_state_77 = None
    mul_138 = torch.ops.aten.mul.Tensor(optimizer_state_78, 0.999);  optimizer_state_78 = None
    addcmul_16 = torch.ops.aten.addcmul.default(mul_138, view_62, view_62, value = 0.0010000000000000009);  mul_138 = view_62 = None
    _to_copy_65 = torch.ops.aten._to_copy.default(add_82, dtype = torch.float64)
    pow_48 = torch.ops.aten.pow.Scalar(0.9, _to_copy_65)
    rsub_49 = torch.ops.aten.rsub.Scalar(pow_48, 1);  pow_48 = None
    pow_49 = torch.ops.aten.pow.Scalar(0.999, _to_copy_65);  _to_copy_65 = None
    rsub_50 = torch.ops.aten.rsub.Scalar(pow_49, 1);  pow_49 = None
    sqrt_32 = torch.ops.aten.sqrt.default(rsub_50);  rsub_50 = None
    sqrt_33 = torch.ops.aten.sqrt.default(addcmul_16)
    _to_copy_66 = torch.ops.aten._to_copy.default(sqrt_32, dtype = torch.float32);  sqrt_32 = None
    div_57 = torch.ops.aten.div.Tensor(sqrt_33, _to_copy_66);  sqrt_33 = _to_copy_66 = None
    add_83 = torch.ops.aten.add.Tensor(div_57, 1e-08);  div_57 = None
    div_58 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_49);  rsub_49 = None
    _to_copy_67 = torch.ops.aten._to_copy.default(div_58, dtype = torch.float32);  div_58 = None
    neg_24 = torch.ops.aten.neg.default(_to_copy_67);  _to_copy_67 = None
    div_59 = torch.ops.aten.div.Tensor(lerp_16, add_83);  add_83 = None
    mul_139 = torch.ops.aten.mul.Tensor(neg_24, div_59);  neg_24 = div_59 = None
    add_84 = torch.ops.aten.add.Tensor(mul_137, mul_139);  mul_137 = mul_139 = None
    add_85 = torch.ops.aten.add.Tensor(optimizer_state_79, 1);  optimizer_state_79 = None
    mul_141 = torch.ops.aten.mul.Tensor(parameter_17, _to_copy);  parameter_17 = None
    lerp_17 = torch.ops.aten.lerp.Scalar(optimizer_state_80, t_32, 0.09999999999999998);  optimizer_state_80 = None
    mul_142 = torch.ops.aten.mul.Tensor(optimizer_state_81, 0.999);  optimizer_state_81 = None
    addcmul_17 = torch.ops.aten.addcmul.default(mul_142, t_32, t_32, value = 0.0010000000000000009);  mul_142 = t_32 = None
    _to_copy_69 = torch.ops.aten._to_copy.default(add_85, dtype = torch.float64)
    pow_50 = torch.ops.aten.pow.Scalar(0.9, _to_copy_69)
    rsub_52 = torch.ops.aten.rsub.Scalar(pow_50, 1);  pow_50 = None
    pow_51 = torch.ops.aten.pow.Scalar(0.999, _to_copy_69);  _to_copy_69 = None
    rsub_53 = torch.ops.aten.rsub.Scalar(pow_51, 1);  pow_51 = None
    sqrt_34 = torch.ops.aten.sqrt.default(rsub_53);  rsub_53 = None
    sqrt_35 = torch.ops.aten.sqrt.default(addcmul_17)
    _to_copy_70 = torch.ops.aten._to_copy.default(sqrt_34, dtype = torch.float32);  sqrt_34 = None
    div_60 = torch.ops.aten.div.Tensor(sqrt_35, _to_copy_70);  sqrt_35 = _to_copy_70 = None
    add_86 = torch.ops.aten.add.Tensor(div_60, 1e-08);  div_60 = None
    div_61 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_52);  rsub_52 = None
    _to_copy_71 = torch.ops.aten._to_copy.default(div_61, dtype = torch.float32);  div_61 = None
    neg_25 = torch.ops.aten.neg.default(_to_copy_71);  _to_copy_71 = None
    div_62 = torch.ops.aten.div.Tensor(lerp_17, add_86);  add_86 = None
    mul_143 = torch.ops.aten.mul.Tensor(neg_25, div_62);  neg_25 = div_62 = None
    add_87 = torch.ops.aten.add.Tensor(mul_141, mul_143);  mul_141 = mul_143 = None
    add_88 = torch.ops.aten.add.Tensor(optimizer_state_82, 1);  optimizer_state_82 = None
    mul_145 = torch.ops.aten.mul.Tensor(parameter_18, _to_copy);  parameter_18 = None
    lerp_18 = torch.ops.aten.lerp.Scalar(optimizer_state_83, view_59, 0.09999999999999998);  optimizer_state_83 = None
    mul_146 = torch.ops.aten.mul.Tensor(optimizer_state_84, 0.999);  optimizer_state_84 = None
    addcmul_18 = torch.ops.aten.addcmul.default(mul_146, view_59, view_59, value = 0.0010000000000000009);  mul_146 = view_59 = None
    _to_copy_73 = torch.ops.aten._to_copy.default(add_88, dtype = torch.float64)
    pow_52 = torch.ops.aten.pow.Scalar(0.9, _to_copy_73)
    rsub_55 = torch.ops.aten.rsub.Scalar(pow_52, 1);  pow_52 = None
    pow_53 = torch.ops.aten.pow.Scalar(0.999, _to_copy_73);  _to_copy_73 = None
    rsub_56 = torch.ops.aten.rsub.Scalar(pow_53, 1);  pow_53 = None
    sqrt_36 = torch.ops.aten.sqrt.default(rsub_56);  rsub_56 = None
    sqrt_37 = torch.ops.aten.sqrt.default(addcmul_18)
    _to_copy_74 = torch.ops.aten._to_copy.default(sqrt_36, dtype = torch.float32);  sqrt_36 = None
    div_63 = torch.ops.aten.div.Tensor(sqrt_37, _to_copy_74);  sqrt_37 = _to_copy_74 = None
    add_89 = torch.ops.aten.add.Tensor(div_63, 1e-08);  div_63 = None
    div_64 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_55);  rsub_55 = None
    _to_copy_75 = torch.ops.aten._to_copy.default(div_64, dtype = torch.float32);  div_64 = None
    neg_26 = torch.ops.aten.neg.default(_to_copy_75);  _to_copy_75 = None
    div_65 = torch.ops.aten.div.Tensor(lerp_18, add_89);  add_89 = None
    mul_147 = torch.ops.aten.mul.Tensor(neg_26, div_65);  neg_26 = div_65 = None
    add_90 = torch.ops.aten.add.Tensor(mul_145, mul_147);  mul_145 = mul_147 = None
    add_91 = torch.ops.aten.add.Tensor(optimizer_state_85, 1);  optimizer_state_85 = None
    mul_149 = torch.ops.aten.mul.Tensor(parameter_19, _to_copy);  parameter_19 = None
    lerp_19 = torch.ops.aten.lerp.Scalar(optimizer_state_86, t_28, 0.09999999999999998);  optimizer_state_86 = None
    mul_150 = torch.ops.aten.mul.Tensor(optimizer_state_87, 0.999);  optimizer_state_87 = None
    addcmul_19 = torch.ops.aten.addcmul.default(mul_150, t_28, t_28, value = 0.0010000000000000009);  mul_150 = t_28 = None
    _to_copy_77 = torch.ops.aten._to_copy.default(add_91, dtype = torch.float64)
    pow_54 = torch.ops.aten.pow.Scalar(0.9, _to_copy_77)
    rsub_58 = torch.ops.aten.rsub.Scalar(pow_54, 1);  pow_54 = None
    pow_55 = torch.ops.aten.pow.Scalar(0.999, _to_copy_77);  _to_copy_77 = None
    rsub_59 = torch.ops.aten.rsub.Scalar(pow_55, 1);  pow_55 = None
    sqrt_38 = torch.ops.aten.sqrt.default(rsub_59);  rsub_59 = None
    sqrt_39 = torch.ops.aten.sqrt.default(addcmul_19)
    _to_copy_78 = torch.ops.aten._to_copy.default(sqrt_38, dtype = torch.float32);  sqrt_38 = None
    div_66 = torch.ops.aten.div.Tensor(sqrt_39, _to_copy_78);  sqrt_39 = _to_copy_78 = None
    add_92 = torch.ops.aten.add.Tensor(div_66, 1e-08);  div_66 = None
    div_67 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_58);  rsub_58 = None
    _to_copy_79 = torch.ops.aten._to_copy.default(div_67, dtype = torch.float32);  div_67 = None
    neg_27 = torch.ops.aten.neg.default(_to_copy_79);  _to_copy_79 = None
    div_68 = torch.ops.aten.div.Tensor(lerp_19, add_92);  add_92 = None
    mul_151 = torch.ops.aten.mul.Tensor(neg_27, div_68);  neg_27 = div_68 = None
    add_93 = torch.ops.aten.add.Tensor(mul_149, mul_151);  mul_149 = mul_151 = None
    add_94 = torch.ops.aten.add.Tensor(optimizer_state_88, 1);  optimizer_state_88 = None
    mul_153 = torch.ops.aten.mul.Tensor(parameter_20, _to_copy);  parameter_20 = None
    lerp_20 = torch.ops.aten.lerp.Scalar(optimizer_state_89, view_47, 0.09999999999999998);  optimizer_state_89 = None
    mul_154 = torch.ops.aten.mul.Tensor(optimizer_state_90, 0.999);  optimizer_state_90 = None
    addcmul_20 = torch.ops.aten.addcmul.default(mul_154, view_47, view_47, value = 0.0010000000000000009);  mul_154 = view_47 = None
    _to_copy_81 = torch.ops.aten._to_copy.default(add_94, dtype = torch.float64)
    pow_56 = torch.ops.aten.pow.Scalar(0.9, _to_copy_81)
    rsub_61 = torch.ops.aten.rsub.Scalar(pow_56, 1);  pow_56 = None
    pow_57 = torch.ops.aten.pow.Scalar(0.999, _to_copy_81);  _to_copy_81 = None
    rsub_62 = torch.ops.aten.rsub.Scalar(pow_57, 1);  pow_57 = None
    sqrt_40 = torch.ops.aten.sqrt.default(rsub_62);  rsub_62 = None
    sqrt_41 = torch.ops.aten.sqrt.default(addcmul_20)
    _to_copy_82 = torch.ops.aten._to_copy.default(sqrt_40, dtype = torch.float32);  sqrt_40 = None
    div_69 = torch.ops.aten.div.Tensor(sqrt_41, _to_copy_82);  sqrt_41 = _to_copy_82 = None
    add_95 = torch.ops.aten.add.Tensor(div_69, 1e-08);  div_69 = None
    div_70 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_61);  rsub_61 = None
    _to_copy_83 = torch.ops.aten._to_copy.default(div_70, dtype = torch.float32);  div_70 = None
    neg_28 = torch.ops.aten.neg.default(_to_copy_83);  _to_copy_83 = None
    div_71 = torch.ops.aten.div.Tensor(lerp_20, add_95);  add_95 = None
    mul_155 = torch.ops.aten.mul.Tensor(neg_28, div_71);  neg_28 = div_71 = None
    add_96 = torch.ops.aten.add.Tensor(mul_153, mul_155);  mul_153 = mul_155 = None
    add_97 = torch.ops.aten.add.Tensor(optimizer_state_91, 1);  optimizer_state_91 = None
    mul_157 = torch.ops.aten.mul.Tensor(parameter_21, _to_copy);  parameter_21 = None
    lerp_21 = torch.ops.aten.lerp.Scalar(optimizer_state_92, t_24, 0.09999999999999998);  optimizer_state_92 = None
    mul_158 = torch.ops.aten.mul.Tensor(optimizer_state_93, 0.999);  optimizer_state_93 = None
    addcmul_21 = torch.ops.aten.addcmul.default(mul_158, t_24, t_24, value = 0.0010000000000000009);  mul_158 = t_24 = None
    _to_copy_85 = torch.ops.aten._to_copy.default(add_97, dtype = torch.float64)
    pow_58 = torch.ops.aten.pow.Scalar(0.9, _to_copy_85)
    rsub_64 = torch.ops.aten.rsub.Scalar(pow_58, 1);  pow_58 = None
    pow_59 = torch.ops.aten.pow.Scalar(0.999, _to_copy_85);  _to_copy_85 = None
    rsub_65 = torch.ops.aten.rsub.Scalar(pow_59, 1);  pow_59 = None
    sqrt_42 = torch.ops.aten.sqrt.default(rsub_65);  rsub_65 = None
    sqrt_43 = torch.ops.aten.sqrt.default(addcmul_21)
    _to_copy_86 = torch.ops.aten._to_copy.default(sqrt_42, dtype = torch.float32);  sqrt_42 = None
    div_72 = torch.ops.aten.div.Tensor(sqrt_43, _to_copy_86);  sqrt_43 = _to_copy_86 = None
    add_98 = torch.ops.aten.add.Tensor(div_72, 1e-08);  div_72 = None
    div_73 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_64);  rsub_64 = None
    _to_copy_87 = torch.ops.aten._to_copy.default(div_73, dtype = torch.float32);  div_73 = None
    neg_29 = torch.ops.aten.neg.default(_to_copy_87);  _to_copy_87 = None
    div_74 = torch.ops.aten.div.Tensor(lerp_21, add_98);  add_98 = None
    mul_159 = torch.ops.aten.mul.Tensor(neg_29, div_74);  neg_29 = div_74 = None
    add_99 = torch.ops.aten.add.Tensor(mul_157, mul_159);  mul_157 = mul_159 = None
    add_100 = torch.ops.aten.add.Tensor(optimizer_state_94, 1);  optimizer_state_94 = None
    mul_161 = torch.ops.aten.mul.Tensor(parameter_22, _to_copy);  parameter_22 = None
    lerp_22 = torch.ops.aten.lerp.Scalar(optimizer_state_95, t_20, 0.09999999999999998);  optimizer_state_95 = None
    mul_162 = torch.ops.aten.mul.Tensor(optimizer_state_96, 0.999);  optimizer_state_96 = None
    addcmul_22 = torch.ops.aten.addcmul.default(mul_162, t_20, t_20, value = 0.0010000000000000009);  mul_162 = t_20 = None
    _to_copy_89 = torch.ops.aten._to_copy.default(add_100, dtype = torch.float64)
    pow_60 = torch.ops.aten.pow.Scalar(0.9, _to_copy_89)
    rsub_67 = torch.ops.aten.rsub.Scalar(pow_60, 1);  pow_60 = None
    pow_61 = torch.ops.aten.pow.Scalar(0.999, _to_copy_89);  _to_copy_89 = None
    rsub_68 = torch.ops.aten.rsub.Scalar(pow_61, 1);  pow_61 = None
    sqrt_44 = torch.ops.aten.sqrt.default(rsub_68);  rsub_68 = None
    sqrt_45 = torch.ops.aten.sqrt.default(addcmul_22)
    _to_copy_90 = torch.ops.aten._to_copy.default(sqrt_44, dtype = torch.float32);  sqrt_44 = None
    div_75 = torch.ops.aten.div.Tensor(sqrt_45, _to_copy_90);  sqrt_45 = _to_copy_90 = None
    add_101 = torch.ops.aten.add.Tensor(div_75, 1e-08);  div_75 = None
    div_76 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_67);  rsub_67 = None
    _to_copy_91 = torch.ops.aten._to_copy.default(div_76, dtype = torch.float32);  div_76 = None
    neg_30 = torch.ops.aten.neg.default(_to_copy_91);  _to_copy_91 = None
    div_77 = torch.ops.aten.div.Tensor(lerp_22, add_101);  add_101 = None
    mul_163 = torch.ops.aten.mul.Tensor(neg_30, div_77);  neg_30 = div_77 = None
    add_102 = torch.ops.aten.add.Tensor(mul_161, mul_163);  mul_161 = mul_163 = None
    add_103 = torch.ops.aten.add.Tensor(optimizer_state_97, 1);  optimizer_state_97 = None
    mul_165 = torch.ops.aten.mul.Tensor(parameter_23, _to_copy);  parameter_23 = None
    lerp_23 = torch.ops.aten.lerp.Scalar(optimizer_state_98, view_42, 0.09999999999999998);  optimizer_state_98 = None
    mul_166 = torch.ops.aten.mul.Tensor(optimizer_state_99, 0.999);  optimizer_state_99 = None
    addcmul_23 = torch.ops.aten.addcmul.default(mul_166, view_42, view_42, value = 0.0010000000000000009);  mul_166 = view_42 = None
    _to_copy_93 = torch.ops.aten._to_copy.default(add_103, dtype = torch.float64)
    pow_62 = torch.ops.aten.pow.Scalar(0.9, _to_copy_93)
    rsub_70 = torch.ops.aten.rsub.Scalar(pow_62, 1);  pow_62 = None
    pow_63 = torch.ops.aten.pow.Scalar(0.999, _to_copy_93);  _to_copy_93 = None
    rsub_71 = torch.ops.aten.rsub.Scalar(pow_63, 1);  pow_63 = None
    sqrt_46 = torch.ops.aten.sqrt.default(rsub_71);  rsub_71 = None
    sqrt_47 = torch.ops.aten.sqrt.default(addcmul_23)
    _to_copy_94 = torch.ops.aten._to_copy.default(sqrt_46, dtype = torch.float32);  sqrt_46 = None
    div_78 = torch.ops.aten.div.Tensor(sqrt_47, _to_copy_94);  sqrt_47 = _to_copy_94 = None
    add_104 = torch.ops.aten.add.Tensor(div_78, 1e-08);  div_78 = None
    div_79 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_70);  rsub_70 = None
    _to_copy_95 = torch.ops.aten._to_copy.default(div_79, dtype = torch.float32);  div_79 = None
    neg_31 = torch.ops.aten.neg.default(_to_copy_95);  _to_copy_95 = None
    div_80 = torch.ops.aten.div.Tensor(lerp_23, add_104);  add_104 = None
    mul_167 = torch.ops.aten.mul.Tensor(neg_31, div_80);  neg_31 = div_80 = None
    add_105 = torch.ops.aten.add.Tensor(mul_165, mul_167);  mul_165 = mul_167 = None
    add_106 = torch.ops.aten.add.Tensor(optimizer_state_100, 1);  optimizer_state_100 = None
    mul_169 = torch.ops.aten.mul.Tensor(parameter_24, _to_copy);  parameter_24 = _to_copy = None
    lerp_24 = torch.ops.aten.lerp.Scalar(optimizer_state_101, t_16, 0.09999999999999998);  optimizer_state_101 = None
    mul_170 = torch.ops.aten.mul.Tensor(optimizer_state_102, 0.999);  optimizer_state_102 = None
    addcmul_24 = torch.ops.aten.addcmul.default(mul_170, t_16, t_16, value = 0.0010000000000000009);  mul_170 = t_16 = None
    _to_copy_97 = torch.ops.aten._to_copy.default(add_106, dtype = torch.float64)
    pow_64 = torch.ops.aten.pow.Scalar(0.9, _to_copy_97)
    rsub_73 = torch.ops.aten.rsub.Scalar(pow_64, 1);  pow_64 = None
    pow_65 = torch.ops.aten.pow.Scalar(0.999, _to_copy_97);  _to_copy_97 = None
    rsub_74 = torch.ops.aten.rsub.Scalar(pow_65, 1);  pow_65 = None
    sqrt_48 = torch.ops.aten.sqrt.default(rsub_74);  rsub_74 = None
    sqrt_49 = torch.ops.aten.sqrt.default(addcmul_24)
    _to_copy_98 = torch.ops.aten._to_copy.default(sqrt_48, dtype = torch.float32);  sqrt_48 = None
    div_81 = torch.ops.aten.div.Tensor(sqrt_49, _to_copy_98);  sqrt_49 = _to_copy_98 = None
    add_107 = torch.ops.aten.add.Tensor(div_81, 1e-08);  div_81 = None
    div_82 = torch.ops.aten.div.Tensor(hyperparam_27, rsub_73);  hyperparam_27 = rsub_73 = None
    _to_copy_99 = torch.ops.aten._to_copy.default(div_82, dtype = torch.float32);  div_82 = None
    neg_32 = torch.ops.aten.neg.default(_to_copy_99);  _to_copy_99 = None
    div_83 = torch.ops.aten.div.Tensor(lerp_24, add_107);  add_107 = None
    mul_171 = torch.ops.aten.mul.Tensor(neg_32, div_83);  neg_32 = div_83 = None
    add_108 = torch.ops.aten.add.Tensor(mul_169, mul_171);  mul_169 = mul_171 = None
    return (getitem_4, add_36, add_34, lerp, addcmul, add_39, add_37, lerp_1, addcmul_1, add_42, add_40, lerp_2, addcmul_2, add_45, add_43, lerp_3, addcmul_3, add_48, add_46, lerp_4, addcmul_4, add_51, add_49, lerp_5, addcmul_5, add_54, add_52, lerp_6, addcmul_6, add_57, add_55, lerp_7, addcmul_7, add_60, add_58, lerp_8, addcmul_8, add_63, add_61, lerp_9, addcmul_9, add_66, add_64, lerp_10, addcmul_10, add_69, add_67, lerp_11, addcmul_11, add_72, add_70, lerp_12, addcmul_12, add_75, add_73, lerp_13, addcmul_13, add_78, add_76, lerp_14, addcmul_14, add_81, add_79, lerp_15, addcmul_15, add_84, add_82, lerp_16, addcmul_16, add_87, add_85, lerp_17, addcmul_17, add_90, add_88, lerp_18, addcmul_18, add_93, add_91, lerp_19, addcmul_19, add_96, add_94, lerp_20, addcmul_20, add_99, add_97, lerp_21, addcmul_21, add_102, add_100, lerp_22, addcmul_22, add_105, add_103, lerp_23, addcmul_23, add_108, add_106, lerp_24, addcmul_24)
    