"""One-off GPU diagnostic: which varlen_attn convention matches a dense causal reference (torch 2.11)."""
import torch, torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn
torch.manual_seed(0)
lens=[30,50]; T=sum(lens); H=4; D=64
q,k,v=(torch.randn(T,H,D,device="cuda",dtype=torch.bfloat16) for _ in range(3))
cu=torch.tensor([0,30,80],dtype=torch.int32,device="cuda")
doc=torch.repeat_interleave(torch.arange(2,device="cuda"),torch.tensor(lens,device="cuda"))
i=torch.arange(T,device="cuda")
for name,allowed in [("causal",(doc[:,None]==doc[None,:])&(i[None,:]<=i[:,None])),("full",doc[:,None]==doc[None,:])]:
    ref=F.scaled_dot_product_attention(q.float().transpose(0,1),k.float().transpose(0,1),v.float().transpose(0,1),attn_mask=allowed).transpose(0,1)
    for ws in [(-1,0),(-1,-1),(0,-1)]:
        out=varlen_attn(q,k,v,cu,cu,50,50,window_size=ws)
        print(name, ws, ((out.float()-ref).norm()/ref.norm()).item(), out.shape)
